"""GGUF blocks multiplied by specflow's native kernel (backends/lean/blocks.py, blocks.c): the
blocks hold what they say (a file's scales and weights as they are, tiled; specflow's own
within half a step), the
product is the blocks' values times the input quantized per block (exactly, up to the float
sums' order), a row's result does not depend on the rows beside it or the thread count, and a
pass through layers held in blocks computes the same natively as eagerly."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specflow.backends.lean import blocks
from specflow.backends.lean.blocks import Q4_1, Q4_K, Q8_0, U8, BlockWeight

pytestmark = pytest.mark.skipif(not blocks.available(),
                                reason="no C compiler: specflow's native kernel is not built")


def quantized_input(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as the product reads it: int8 per block of 32, scale max |x| / 127."""
    M, K = x.shape
    g = x.reshape(M, K // 32, 32)
    amax = g.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return (torch.round(g * inv).clamp(-127, 127) * (amax / 127)).reshape(M, K)


@pytest.mark.parametrize("K", [64, 96, 576])                      # 96: an odd number of blocks
@pytest.mark.parametrize("kind", ["q4", "q4g64", "q8"])
def test_the_product_is_the_blocks_times_the_input_quantized_per_block(kind, K):
    if kind == "q4g64" and K % 64:
        pytest.skip("group 64 needs a width that is a multiple of 64")
    torch.manual_seed(0)
    w = torch.randn(40, K)
    held = blocks.quantize_q8(w) if kind == "q8" else \
        blocks.quantize_q4(w, 64 if kind == "q4g64" else 32)
    values = held.dequantize()                                                     # [N, K]
    if kind == "q8":
        step = (w.view(40, -1, 32).abs().amax(-1) / 127).repeat_interleave(32, 1)
    else:
        g = 64 if kind == "q4g64" else 32
        grouped = w.view(40, -1, g)
        step = ((grouped.amax(-1) - grouped.amin(-1)) / 15).repeat_interleave(g, 1)
    # within half a step, plus the float16 rounding of the scale and minimum
    assert ((values - w).abs() <= step / 2 + 2e-3 * w.abs().amax()).all()
    x = torch.randn(11, K) * 3
    want = quantized_input(x).double() @ values.double().T                        # [M, N]
    got = held.matmul(x)
    assert ((got - want).abs().max() / want.abs().max()) < 1e-6
    assert held.matmul(x.bfloat16()).dtype == torch.bfloat16
    for rows in (1, 3, 8, 9):         # a row's bits do not depend on the rows beside it
        assert torch.equal(held.matmul(x[:rows]), got[:rows])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(held.matmul(x), got)                   # nor on the thread count
    finally:
        torch.set_num_threads(threads)
    # tiles of 16 rows (40 -> 48): Q4_1 20 bytes a block, Q8_0 38 (its 34, and the row sum)
    assert held.nbytes() == 48 * K // 32 * (38 if kind == "q8" else 20)


def test_the_input_quantization_rounds_ties_to_even_and_keeps_empty_and_lopsided_blocks():
    """The activations' int8 blocks (vectors, in the product's threads): a block whose largest
    |x| is 127 has x x 127 / max = x, so halves are ties and round to even (2.5 -> 2, 3.5 -> 4,
    -2.5 -> -2); an all-zero block adds nothing (no 0/0); a block of one large value leaves its
    small ones at 0; every row of every split, at 1 and 2 threads, as the reference."""
    torch.manual_seed(1)
    K = 32 * 6
    held = blocks.quantize_q4(torch.randn(24, K))
    values = held.dequantize().double()
    x = torch.randn(7, K)
    x[:, :32] = torch.tensor([127.0, 2.5, 3.5, -2.5, 0.5, -0.5, 1.5, 126.5] * 4)  # ties
    x[:, 32:64] = 0.0                                                             # empty
    x[:, 64:96] = 1e-3
    x[:, 64] = 1e3                                                               # lopsided
    q = quantized_input(x)
    assert q[0, 1].item() == 2.0 and q[0, 2].item() == 4.0 and q[0, 3].item() == -2.0
    assert (q[:, 32:64] == 0).all() and (q[:, 65:96] == 0).all()
    want = q.double() @ values.T
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for rows in (1, 2, 5, 7):
                got = held.matmul(x[:rows]).double()
                assert ((got - want[:rows]).abs().max() / want.abs().max()) < 1e-6, (t, rows)
    finally:
        torch.set_num_threads(threads)


def test_a_files_blocks_keep_their_scales_and_weights_and_q4_0_reads_as_q4_1():
    """ggml's layouts: Q4_0 [d, 16 nibble bytes], Q4_1 [d, m, 16 bytes], Q8_0 [d, 32 int8];
    byte j of a Q4 block holds weight j low and weight j + 16 high. Held tiled, the same
    scales, minimums and quantized weights come back, whatever the rows' count (here 20: a
    tile and a part)."""
    rng = np.random.default_rng(0)
    N, G = 20, 3
    d = (rng.random((N, G)) / 10).astype(np.float16)
    m = (-rng.random((N, G))).astype(np.float16)
    q = rng.integers(0, 16, (N, G, 32)).astype(np.uint8)
    nibbles = q[..., :16] | (q[..., 16:] << 4)
    q4_1 = np.concatenate([d[..., None].view(np.uint8), m[..., None].view(np.uint8), nibbles], -1)
    held = blocks.from_file_blocks(q4_1.reshape(N, -1), "Q4_1")
    assert held.kind_code == Q4_1 and held.shape == (N, G * 32)
    got_d, got_m, got_q = held.parts()
    assert np.array_equal(got_d, d) and np.array_equal(got_m, m) and np.array_equal(got_q, q)
    want = q.astype(np.float32) * d[..., None].astype(np.float32) + m[..., None].astype(np.float32)
    assert np.array_equal(held.dequantize().numpy(), want.reshape(N, -1))
    q4_0 = np.concatenate([d[..., None].view(np.uint8), nibbles], -1)
    held = blocks.from_file_blocks(q4_0.reshape(N, -1), "Q4_0")
    want = (q.astype(np.float32) - 8) * d[..., None].astype(np.float32)
    assert np.array_equal(held.dequantize().numpy(), want.reshape(N, -1))
    q8 = rng.integers(-127, 128, (N, G, 32)).astype(np.int8)
    q8_0 = np.concatenate([d[..., None].view(np.uint8), q8.view(np.uint8)], -1)
    held = blocks.from_file_blocks(q8_0.reshape(N, -1), "Q8_0")
    assert held.kind_code == Q8_0
    got_d, got_m, got_q = held.parts()
    assert np.array_equal(got_d, d) and got_m is None and np.array_equal(got_q, q8)
    want = q8.astype(np.float32) * d[..., None].astype(np.float32)
    assert np.array_equal(held.dequantize().numpy(), want.reshape(N, -1))
    x = torch.randn(3, G * 32)                      # the partial tile's rows multiply right
    ref = quantized_input(x).double() @ held.dequantize().double().T
    assert ((held.matmul(x) - ref).abs().max() / ref.abs().max()) < 1e-6
    with pytest.raises(ValueError, match="Q3_K blocks are not held as they are"):
        blocks.from_file_blocks(q8_0.reshape(N, -1), "Q3_K")


# the kind each file type is held in, and its bytes a tile block (16 rows x 32 weights)
HELD_AS = {"Q4_0": Q4_1, "Q4_1": Q4_1, "Q5_0": Q8_0, "Q5_1": U8, "Q8_0": Q8_0, "Q4_K": Q4_K,
           "Q5_K": U8, "Q6_K": U8}


@pytest.mark.parametrize("type_name", list(HELD_AS))
def test_every_file_type_is_held_exactly_and_multiplies_right(type_name):
    """Each type's blocks go into the kind that holds their values (K-quants' sub-block scales
    multiplied out in float32): the values equal the `gguf` package's dequantization bit for
    bit, and the product is those values times the input quantized per block."""
    gguf = pytest.importorskip("gguf")
    from tests.backends.lean.gguf_fakes import random_blocks

    rng = np.random.default_rng(4)
    K = 512 if type_name.endswith("_K") else 96
    data = random_blocks(type_name, 20, K, rng)
    held = blocks.from_file_blocks(data, type_name)
    assert held.kind_code == HELD_AS[type_name] and held.shape == (20, K)
    qtype = getattr(gguf.GGMLQuantizationType, type_name)
    want = torch.from_numpy(gguf.quants.dequantize(data, qtype)).float()
    assert torch.equal(held.dequantize(), want)
    assert held.nbytes() == 2 * K // 32 * blocks.TILE_BYTES[held.kind_code]        # 2 tiles
    x = torch.randn(9, K) * 3
    ref = quantized_input(x).double() @ want.double().T
    got = held.matmul(x)
    assert ((got - ref).abs().max() / ref.abs().max()) < 1e-6
    for rows in (1, 4):
        assert torch.equal(held.matmul(x[:rows]), got[:rows])
    torch.testing.assert_close(blocks.reorder_rows(held, torch.arange(19, -1, -1)).dequantize(),
                               want.flip(0), rtol=0, atol=0)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_K", "Q8_0", "Q6_K"])     # the four kinds
def test_rows_are_looked_up_as_their_values(type_name):
    """An embedding table held in its blocks: rows() gives dequantize()'s rows bit for bit."""
    from tests.backends.lean.gguf_fakes import random_blocks

    held = blocks.from_file_blocks(random_blocks(type_name, 37, 256, np.random.default_rng(6)),
                                   type_name)
    ids = torch.tensor([[36, 0, 17], [5, 5, 16]])
    assert torch.equal(held.rows(ids), held.dequantize()[ids])
    with pytest.raises(IndexError, match="outside 0..36"):
        held.rows(torch.tensor([37]))


def test_fused_products_of_two_types_are_held_in_a_kind_that_holds_both():
    """A Q4_K_M file's q, k (Q4_K) and v (Q6_K) stack into one product: Q4_1 with Q4_K as
    Q4_K (wider scales), anything else as U8 (Q8_0's q as q + 128, m = -128 d): the same
    values either way."""
    from tests.backends.lean.gguf_fakes import random_blocks

    rng = np.random.default_rng(5)
    parts = {t: blocks.from_file_blocks(random_blocks(t, 16 + 8 * i, 256, rng), t)
             for i, t in enumerate(("Q4_0", "Q4_K", "Q6_K", "Q8_0"))}
    for names, kind in ((("Q4_0", "Q4_K"), Q4_K), (("Q4_K", "Q6_K"), U8),
                        (("Q4_0", "Q8_0"), U8), (("Q4_K", "Q4_K", "Q6_K", "Q8_0"), U8)):
        both = blocks.stack([parts[n] for n in names])
        assert both.kind_code == kind
        want = torch.cat([parts[n].dequantize() for n in names])
        assert torch.equal(both.dequantize(), want)
        x = torch.randn(3, 256)
        ref = quantized_input(x).double() @ want.double().T
        assert ((both.matmul(x) - ref).abs().max() / ref.abs().max()) < 1e-6
    assert blocks.stack([parts["Q4_K"], parts["Q6_K"]]).describe() == "Q4_K + Q6_K blocks held as U8"


def test_rows_reorder_and_stack_with_their_blocks():
    torch.manual_seed(2)
    a, b = blocks.quantize_q4(torch.randn(6, 64)), blocks.quantize_q4(torch.randn(4, 64))
    order = torch.tensor([5, 0, 3, 1, 2, 4])
    torch.testing.assert_close(blocks.reorder_rows(a, order).dequantize(),
                               a.dequantize()[order], rtol=0, atol=0)
    both = blocks.stack([a, b])
    assert isinstance(both, BlockWeight) and both.shape == (10, 64)
    torch.testing.assert_close(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]),
                               rtol=0, atol=0)


@pytest.mark.parametrize("bits", [4, 8])
def test_a_pass_through_layers_held_in_blocks_is_the_same_natively_and_eagerly(bits):
    """The native pass runs the eager layers' block products inside its one call: a model held
    in blocks scores nearly the same whichever way its pass runs, and runs natively for every
    pass size without a timing. Not to float rounding: where the norms, rotary or attention
    round an input differently, its int8 quantization can land one step apart (1/127 of its
    block's largest value), so the two ways differ by ~0.1% of the logits' spread (a pipeline
    runs every pass of a size one way: speculation stays exact against it)."""
    from specflow.backends.hf.backend import DEMO_DIR, HFBackend, HFModelConfig

    backend = HFBackend(HFModelConfig(path=str(DEMO_DIR / "target"), dtype=f"int{bits}"),
                        torch.device("cpu"), slots=2)
    lean = backend.lean
    assert isinstance(lean.layers[0][1], BlockWeight) and isinstance(lean.lm_head, BlockWeight)
    assert lean.native_pass_rows() == "1-128 queries" and backend.dtype == torch.float32
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, 8000, (2, 30), generator=g)
    fed = torch.randint(1, 8000, (2, 5), generator=g)
    logits = {}
    for native in (True, False):
        lean.native_layers = native
        for slot in (0, 1):
            backend.reset(slot)
            backend.forward(torch.tensor([slot]), prompts[slot:slot + 1], torch.tensor([30]),
                            logits=False)
        logits[native] = backend.forward(torch.arange(2), fed, torch.tensor([5, 5]))
    apart = (logits[True] - logits[False]).abs()
    spread = logits[False].std()
    assert apart.mean() < 3e-3 * spread and apart.max() < 0.05 * spread
    assert torch.equal(logits[True].argmax(-1), logits[False].argmax(-1))


def test_the_portable_path_computes_what_the_vnni_path_does(tmp_path):
    """Built without -march=native (no AVX-512 VNNI), the product takes its portable loops:
    the same integer sums and the same float steps in block order."""
    import ctypes
    import subprocess

    from specflow.backends.lean import native

    compiler = native._compiler()
    built = tmp_path / "portable.so"
    flags = [f for f in native.FLAGS if f != "-march=native"]
    subprocess.run([compiler, *flags, str(native.SOURCE), "-o", str(built)], check=True,
                   capture_output=True, timeout=120)
    lib = ctypes.CDLL(str(built))
    assert lib.specflow_blocks_vnni() == 0
    lib.specflow_held.argtypes = native._library().specflow_held.argtypes
    from tests.backends.lean.gguf_fakes import random_blocks

    torch.manual_seed(3)
    rng = np.random.default_rng(3)
    w, x = torch.randn(40, 256), torch.randn(5, 256)
    held = [blocks.quantize_q4(w), blocks.quantize_q8(w),
            *(blocks.from_file_blocks(random_blocks(t, 40, 256, rng), t) for t in ("Q4_K", "Q6_K"))]
    assert [h.kind_code for h in held] == [Q4_1, Q8_0, Q4_K, U8]
    for h in held:
        out = torch.empty(5, 40)
        assert lib.specflow_held(h.data_ptr(), h.kind_code, x.data_ptr(), out.data_ptr(),
                                   40, 256, 5, 1, None, 0.0) == 0
        want = h.matmul(x)      # up to the fusing of multiply-adds: 1e-6 of the row's scale
        assert (out - want).abs().max() <= 1e-6 * want.abs().max(), blocks.NAMES[h.kind_code]


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_1"])
def test_a_file_mapped_tensor_is_tiled_in_chunks_and_its_pages_handed_back(tmp_path, type_name):
    """from_file_blocks over more rows than a chunk (the last tile padded): the tiles of a
    read-only file mapping equal those of the same bytes in memory, and the mapping's pages
    are no longer in the process once tiled (/proc/self/smaps: the 2-2.5 MB file's pages all
    stay resident without the hand-back), the file's bytes unchanged."""
    import pathlib
    import re

    size, _ = blocks.FILE_BLOCK[type_name]
    N, G = blocks.CHUNK + 40, 24
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (N, G, size), dtype=np.uint8)
    raw[..., 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)           # d
    if type_name == "Q4_1":
        raw[..., 2:4] = np.frombuffer(np.float16(-0.05).tobytes(), np.uint8)      # m
    path = tmp_path / f"t.{type_name}"
    raw.reshape(N, -1).tofile(path)
    want = blocks.from_file_blocks(raw.reshape(N, -1).copy(), type_name)
    mapped = np.memmap(path, np.uint8, "r", 0, (N, G * size))
    got = blocks.from_file_blocks(np.asarray(mapped), type_name)
    assert torch.equal(got.data, want.data) and got.shape == want.shape
    assert torch.equal(got.rows(torch.tensor([0, N - 1])), want.rows(torch.tensor([0, N - 1])))
    smaps = pathlib.Path("/proc/self/smaps")
    if smaps.is_file():
        text = smaps.read_text()
        at = text.index(str(path))
        rss = int(re.search(r"^Rss:\s+(\d+) kB", text[at:], re.M).group(1))
        # the kernel's fault-around maps up to 64 KB of cached neighbours with a page it faults
        # in, some of them in the chunk before: a window per chunk boundary is allowed
        assert rss * 1024 < 0.05 * path.stat().st_size + 2 * 65536, rss
    assert np.array_equal(np.fromfile(path, np.uint8).reshape(N, -1), raw.reshape(N, -1))
    del mapped
