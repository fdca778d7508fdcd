"""The tensor table of a GGUF file read without its metadata's values (backends/lean/
gguf_index.py): the same tensors, types and bytes as the `gguf` package's reader finds, past
string arrays, nested arrays and a non-default alignment."""
from __future__ import annotations

import numpy as np
import pytest

from specflow.backends.lean import gguf_index

gguf = pytest.importorskip("gguf")


def test_the_index_finds_what_the_gguf_reader_finds(tmp_path):
    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("general.alignment", 64)
    w.add_token_list(["a", "bb", "ccc\u00e9", ""] * 50)
    w.add_array("test.nested", [[1, 2], [3, 4, 5]])
    w.add_array("test.floats", [0.5, 1.5])
    w.add_string("test.name", "tiny")
    rng = np.random.default_rng(0)
    w.add_tensor("norm.weight", rng.standard_normal(64).astype(np.float32))
    for name, kind in (("a.weight", "Q4_0"), ("b.weight", "Q4_1"), ("c.weight", "Q8_0")):
        qtype = getattr(gguf.GGMLQuantizationType, kind)
        w.add_tensor(name, gguf.quants.quantize(rng.standard_normal((6, 96)).astype(np.float32),
                                                qtype), raw_dtype=qtype)
    w.add_tensor("h.weight", rng.standard_normal((3, 5)).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    theirs = gguf.GGUFReader(str(path)).tensors
    ours = gguf_index.read(str(path))
    assert [t.name for t in ours] == [t.name for t in theirs]
    for a, b in zip(ours, theirs):
        assert a.tensor_type == b.tensor_type, a.name
        assert a.data.shape == b.data.shape and a.data.dtype == b.data.dtype, a.name
        assert np.array_equal(np.asarray(a.data), np.asarray(b.data)), a.name


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "not.gguf"
    path.write_bytes(b"GGML" + bytes(40))
    with pytest.raises(ValueError, match="is not a GGUF file"):
        gguf_index.read(str(path))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (5).to_bytes(8, "little")
                    + (1).to_bytes(8, "little") + b"\x10")
    with pytest.raises(ValueError, match="ends inside its GGUF header"):
        gguf_index.read(str(cut))
