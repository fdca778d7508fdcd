"""The tensor table of a GGUF file, read without its metadata's values.

`gguf.GGUFReader` builds every metadata field as numpy parts first, one Python call per element:
over SmolLM2's file (a 49,152-token vocabulary and its merges) that is ~2.4 s of a ~5 s start,
spent only to find where the tensors are. Here the fields are stepped over (a string array is
one length read per string), the tensor infos read, and each tensor's bytes mapped from the
file on demand: `read(path)` -> [GGUFTensor] with the reader's `name`, `tensor_type` and `data`
(quantized types: uint8 [rows, bytes a row]; float types: their dtype in the tensor's shape).
Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (version 2 and 3).
"""
from __future__ import annotations

import functools
import mmap
import struct

import numpy as np

SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9
FLOATS = {"F32": np.float32, "F16": np.float16, "F64": np.float64}


class GGUFTensor:
    def __init__(self, path: str, name: str, dims: tuple[int, ...], kind: int, offset: int):
        import gguf

        self.path, self.name, self.dims, self.offset = path, name, dims, offset
        self.tensor_type = gguf.GGMLQuantizationType(kind)

    @property
    def data(self) -> np.ndarray:
        """The tensor's bytes as the file holds them, mapped read-only."""
        import gguf

        name = self.tensor_type.name
        shape = tuple(reversed(self.dims))                      # rows first, as gguf reads it
        if name in FLOATS:
            return np.memmap(self.path, FLOATS[name], "r", self.offset, shape)
        block, size = gguf.GGML_QUANT_SIZES[self.tensor_type]
        row = self.dims[0] // block * size
        rows = int(np.prod(self.dims[1:], dtype=np.int64)) if len(self.dims) > 1 else 1
        return np.memmap(self.path, np.uint8, "r", self.offset, (rows, row))


def _string(buf, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    return bytes(buf[pos + 8:pos + 8 + n]).decode("utf-8", "replace"), pos + 8 + n


def _skip(buf, pos: int, kind: int) -> int:
    """The position after a value of `kind` at `pos`."""
    if kind in SCALAR_BYTES:
        return pos + SCALAR_BYTES[kind]
    if kind == STRING:
        return pos + 8 + struct.unpack_from("<Q", buf, pos)[0]
    if kind == ARRAY:
        item, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if item in SCALAR_BYTES:
            return pos + count * SCALAR_BYTES[item]
        for _ in range(count):
            pos = _skip(buf, pos, item)
        return pos
    raise ValueError(f"unknown GGUF value type {kind} at byte {pos}")


@functools.lru_cache(maxsize=2)
def read(path: str) -> list[GGUFTensor]:
    """Every tensor of the GGUF file at `path` (its metadata stepped over, but its alignment).
    ValueError: not a GGUF file, or one cut short."""
    try:
        return _read(path)
    except struct.error as exc:
        raise ValueError(f"{path} ends inside its GGUF header ({exc})") from exc


def _read(path: str) -> list[GGUFTensor]:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        magic, version, tensors, fields = struct.unpack_from("<4sIQQ", buf, 0)
        if magic != b"GGUF" or version < 2:
            raise ValueError(f"{path} is not a GGUF file of version 2 or later")
        pos, alignment = 24, 32
        for _ in range(fields):
            key, pos = _string(buf, pos)
            (kind,) = struct.unpack_from("<I", buf, pos)
            pos += 4
            if key == "general.alignment" and kind == 4:
                (alignment,) = struct.unpack_from("<I", buf, pos)
            pos = _skip(buf, pos, kind)
        infos = []
        for _ in range(tensors):
            name, pos = _string(buf, pos)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            kind, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            infos.append((name, dims, kind, offset))
        start = -(-pos // alignment) * alignment
    return [GGUFTensor(path, name, dims, kind, start + offset) for name, dims, kind, offset in infos]
