"""Weights held in GGUF's own blocks, multiplied by specflow's native kernel (`blocks.c`):
`dtype=int4` and `dtype=int8` where the kernel builds, and a GGUF file's Q4_0 / Q4_1 / Q5_0 /
Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K tensors at `dtype=auto` as the file holds them.

A block is 32 weights of a row with its scale(s), minimum and quantized weights, moved into
tiles of 16 rows (blocks.c says why: one VNNI instruction then serves 16 rows). Four tile kinds
hold every type above with the file's own values (each type's dequantized values equal the
`gguf` package's bit for bit, tests/backends/lean/test_gguf_blocks.py):

| kind | a block | bits a weight | holds |
|---|---|---:|---|
| Q4_1 | float16 d, m; 4-bit q; q x d + m | 5 | Q4_1; Q4_0 ((q - 8) x d as m = -8d); dtype=int4 |
| Q4_K | float32 d, m; 4-bit q | 6 | Q4_K (d x 6-bit scale, dmin x 6-bit minimum) |
| Q8_0 | float16 d; int8 q; q x d | 9.5 | Q8_0; Q5_0 ((q - 16) x d); dtype=int8 |
| U8 | float32 s, m per 16; 8-bit q; q x s + m | 12 | Q5_1, Q5_K, Q6_K (m = -32 s); fused mixes |

A K-quant's super-block of 256 is 8 (Q6_K: 16) sub-blocks with their own scales: the scales
multiply out exactly in float32 (a float16 times a 6- or 8-bit integer), not in float16, hence
the float32 kinds. Products the lean forward fuses (q/k/v, gate/up) whose files' types differ
(a Q4_K_M file's attn_v is Q6_K beside Q4_K q and k) are held in one kind that holds both
exactly: Q4_K for Q4_1 with Q4_K, else U8 (Q8_0's q as q + 128 with m = -128 d).

The product quantizes its input rows to int8 per block and sums each block's products as
integers (llama.cpp's arithmetic for these files), reading the weight once, and it is also what
the native pass (`native_pass.py`) runs inside its one call, so a model held in blocks computes
every product the same way whether its pass is native or eager.

specflow's own int4 (`quantize_q4`) writes Q4_1 blocks: each group of `group_size` weights (a
multiple of 32) shares d = (max - min) / 15 and m = min, both rounded to float16 first and q
rounded against them; int8 (`quantize_q8`) writes Q8_0 blocks, d = max |w| / 127.
"""
from __future__ import annotations

import numpy as np
import torch

from specflow.backends.lean import native

QK = 32
TR = 16                                # rows per tile
Q4_1, Q8_0, Q4_K, U8 = 3, 4, 6, 7      # blocks.c's kinds
TILE_BYTES = {Q4_1: 320, Q8_0: 608, Q4_K: 384, U8: 768}   # a tile's bytes per block (16 rows)
NAMES = {Q4_1: "Q4_1", Q8_0: "Q8_0", Q4_K: "Q4_K", U8: "U8"}
BITS = {Q4_1: 4, Q4_K: 4, Q8_0: 8, U8: 8}
SCALE_DTYPE = {Q4_1: np.float16, Q8_0: np.float16, Q4_K: np.float32, U8: np.float32}


def available() -> bool:
    """The native block product runs here (a C compiler built specflow's kernel)."""
    return native.available(torch.float32)


def fits(shape) -> bool:
    return shape[1] % QK == 0


def _by_tile(a: np.ndarray, T: int, per_block: int) -> np.ndarray:
    """[T x 16, G x per_block] scales -> bytes [T, G, per_block x 16 x itemsize]: each block's
    per_block scale vectors of the tile's 16 rows."""
    G = a.shape[1] // per_block
    t = a.reshape(T, TR, G, per_block).transpose(0, 2, 3, 1)                # [T, G, part, 16]
    return np.ascontiguousarray(t).view(np.uint8).reshape(T, G, -1)


def _from_tile(b: np.ndarray, dtype, per_block: int) -> np.ndarray:
    """_by_tile's inverse: bytes [T, G, n] -> [T x 16, G x per_block]."""
    T, G = b.shape[:2]
    t = np.ascontiguousarray(b).view(dtype).reshape(T, G, per_block, TR)
    return t.transpose(0, 3, 1, 2).reshape(T * TR, G * per_block)


CHUNK = 4096        # rows tiled at a time: the temporaries stay small beside the tiles


def _tile(kind: int, d: np.ndarray, m: np.ndarray | None, q: np.ndarray) -> np.ndarray:
    """Blocks' parts -> blocks.c's tiles: d, m [N, G] (U8: [N, 2G], per 16) in the kind's
    SCALE_DTYPE, q [N, G, 32] (Q4_1/Q4_K: uint8 in 0..15; Q8_0: int8; U8: uint8) -> uint8
    [tiles, G, TILE_BYTES] (rows past N zero), CHUNK rows at a time."""
    N, G = q.shape[:2]
    out = np.empty((-(-N // TR), G, TILE_BYTES[kind]), np.uint8)
    for r in range(0, N, CHUNK):
        out[r // TR:(r + CHUNK) // TR] = _tile_rows(
            kind, d[r:r + CHUNK], None if m is None else m[r:r + CHUNK], q[r:r + CHUNK])
    return out


def _tile_rows(kind: int, d: np.ndarray, m: np.ndarray | None, q: np.ndarray) -> np.ndarray:
    """_tile of a few rows (a multiple of 16, or the last)."""
    N, G = q.shape[:2]
    T = -(-N // TR)
    pad = T * TR - N
    d = d.astype(SCALE_DTYPE[kind])
    q = q.astype(np.int8 if kind == Q8_0 else np.uint8, copy=False)
    if m is not None:
        m = m.astype(SCALE_DTYPE[kind])
    if pad:
        d = np.concatenate([d, np.zeros((pad, d.shape[1]), d.dtype)])
        q = np.concatenate([q, np.zeros((pad, G, QK), q.dtype)])
        if m is not None:
            m = np.concatenate([m, np.zeros((pad, m.shape[1]), m.dtype)])
    per = d.shape[1] // G
    if kind in (Q4_1, Q4_K):
        q = q.reshape(T, TR, G, 2, 4, 4)                                # [T, i, G, half, c, u]
        packed = q[:, :, :, 0] | (q[:, :, :, 1] << 4)                   # [T, i, G, c, u]
        qs = packed.transpose(0, 2, 3, 1, 4).reshape(T, G, 256)         # [T, G, c, i, u]
        parts = [qs, _by_tile(d, T, per), _by_tile(m, T, per)]
    else:
        q8 = q.reshape(T, TR, G, 8, 4)                                  # [T, i, G, k, u]
        qs = np.ascontiguousarray(q8.transpose(0, 2, 3, 1, 4)).reshape(T, G, 512).view(np.uint8)
        if kind == U8:
            parts = [qs, _by_tile(d, T, per), _by_tile(m, T, per)]
        else:
            start = -128 * q8.sum((3, 4), dtype=np.int32)                # [T, i, G]
            parts = [qs, _by_tile(d, T, per),
                     np.ascontiguousarray(start.transpose(0, 2, 1)).view(np.uint8)]
    return np.ascontiguousarray(np.concatenate(
        [np.ascontiguousarray(p).reshape(T, G, -1) for p in parts], -1))


def _untile(kind: int, data: np.ndarray, N: int, G: int):
    """_tile's inverse: (d, m or None (Q8_0), q) by row."""
    tiles = data.reshape(-1, G, TILE_BYTES[kind])
    T = tiles.shape[0]
    if kind in (Q4_1, Q4_K):
        packed = tiles[..., :256].reshape(T, G, 4, TR, 4).transpose(0, 3, 1, 2, 4)  # [T, i, G, c, u]
        q = np.stack([packed & 0x0F, packed >> 4], 3).reshape(T * TR, G, QK)
        size = np.dtype(SCALE_DTYPE[kind]).itemsize * TR
        d = _from_tile(tiles[..., 256:256 + size], SCALE_DTYPE[kind], 1)
        m = _from_tile(tiles[..., 256 + size:256 + 2 * size], SCALE_DTYPE[kind], 1)
        return d[:N], m[:N], q[:N]
    qdtype = np.uint8 if kind == U8 else np.int8
    q = tiles[..., :512].copy().view(qdtype).reshape(T, G, 8, TR, 4).transpose(0, 3, 1, 2, 4)
    q = q.reshape(T * TR, G, QK)[:N]
    if kind == U8:
        d = _from_tile(tiles[..., 512:640], np.float32, 2)
        m = _from_tile(tiles[..., 640:768], np.float32, 2)
        return d[:N], m[:N], q
    return _from_tile(tiles[..., 512:544], np.float16, 1)[:N], None, q


def _as_kind(kind: int, to: int, d, m, q):
    """A weight's parts in kind `to`, the same values: Q4_1 -> Q4_K (wider scales); anything ->
    U8 (scales per 16; Q8_0's q as q + 128 with m = -128 d, exact in float32)."""
    if kind == to:
        return d, m, q
    if to == Q4_K and kind == Q4_1:
        return d.astype(np.float32), m.astype(np.float32), q
    if to != U8:
        raise ValueError(f"{NAMES[kind]} blocks are not held as {NAMES[to]}")
    per = 2 // (d.shape[1] // q.shape[1])                                   # 2, or 1 from U8
    s = np.repeat(d.astype(np.float32), per, 1)
    if kind == Q8_0:
        return s, -128 * s, (q.astype(np.int16) + 128).astype(np.uint8)
    return s, np.repeat(m.astype(np.float32), per, 1), q.astype(np.uint8)


class BlockWeight(native.HeldWeight):
    """W [N, K] as blocks of 32 weights, tiled for blocks.c (`data` uint8 [N / 16 tiles x
    K / 32 x TILE_BYTES]); `matmul(x)` is x [..., K] @ W^T -> [..., N] in x's dtype (computed
    in float32)."""

    def __init__(self, kind: int, d: np.ndarray, m: np.ndarray | None, q: np.ndarray,
                 group_size: int = QK, source: str | None = None):
        """d, m (None for Q8_0) [N, G] (U8: [N, 2G]), q [N, G, 32]: the blocks' parts (_tile);
        `source`: the file's type they came from, for describe()."""
        self._hold(kind, _tile(kind, d, m, q), q.shape[0], group_size, source)

    @classmethod
    def from_tiles(cls, kind: int, tiles: np.ndarray, N: int, group_size: int = QK,
                   source: str | None = None) -> BlockWeight:
        """A weight of N rows from tiles already laid out (_tile's uint8 [tiles, G, bytes])."""
        held = cls.__new__(cls)
        held._hold(kind, tiles, N, group_size, source)
        return held

    def _hold(self, kind: int, tiles: np.ndarray, N: int, group_size: int,
              source: str | None) -> None:
        self.kind_code = kind
        self.bits = BITS[kind]
        self.source = source
        self.shape = torch.Size((N, tiles.shape[1] * QK))
        self.data = torch.from_numpy(tiles.reshape(-1))
        self.group_size = group_size

    def parts(self):
        """(d, m or None, q): the blocks' scales, minimums and quantized weights by row."""
        return _untile(self.kind_code, self.data.numpy(), self.shape[0], self.shape[1] // QK)

    def dequantize(self) -> torch.Tensor:
        """W [N, K] float32: each block's values as the kernel reads them."""
        d, m, q = self.parts()
        N, K = self.shape
        sub = q.reshape(N, d.shape[1], -1).astype(np.float32)        # [N, blocks, 32 or 16]
        values = sub * d.astype(np.float32)[..., None]
        if m is not None:
            values += m.astype(np.float32)[..., None]
        return torch.from_numpy(values.reshape(N, K))

    def first_rows(self, n: int) -> BlockWeight | None:
        """The first n rows (n a multiple of 16: whole tiles, a view of data), or None."""
        if n % TR:
            return None
        tiles = self.data.numpy().reshape(-(-self.shape[0] // TR), self.shape[1] // QK, -1)
        return BlockWeight.from_tiles(self.kind_code, tiles[:n // TR], n, self.group_size,
                                      self.source)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] long -> [..., K] float32: those rows' values (dequantize()'s, bit for bit),
        read from the tiles alone: an embedding table held in its blocks, looked up."""
        N, K = self.shape
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(flat.numel(), K, dtype=torch.float32)                    # [n, K]
        if flat.numel() and native._library().specflow_block_rows(
                self.data_ptr(), self.kind_code, flat.data_ptr(), flat.numel(), N, K,
                out.data_ptr()):
            raise IndexError(f"a row id outside 0..{N - 1}: {flat.min()}..{flat.max()}")
        return out.reshape(*ids.shape, K)

    def describe(self) -> str:
        if self.source is not None and self.source != NAMES[self.kind_code]:
            return f"{self.source} blocks held as {NAMES[self.kind_code]}"
        if self.kind_code == Q8_0:
            return "int8 weights in Q8_0 blocks (a scale per 32)"
        if self.kind_code == Q4_1:
            return f"int4 weights in Q4_1 blocks (a scale and minimum per {self.group_size})"
        return f"{NAMES[self.kind_code]} blocks"


FILE_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
# a block's bytes in the file, and the weights it holds
FILE_BLOCK = {"Q4_0": (18, 32), "Q4_1": (20, 32), "Q5_0": (22, 32), "Q5_1": (24, 32),
              "Q8_0": (34, 32), "Q4_K": (144, 256), "Q5_K": (176, 256), "Q6_K": (210, 256)}


def _f16(b: np.ndarray) -> np.ndarray:
    """[..., 2] bytes -> [...] float32 (a float16, widened exactly)."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _k_scales(scales: np.ndarray):
    """A Q4_K / Q5_K super-block's 12 bytes of 6-bit scales and minimums [..., 12] -> (sc, mn)
    [..., 8] (ggml's get_scale_min_k4)."""
    s = scales.reshape(*scales.shape[:-1], 3, 4)
    d, m, md = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], -1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], -1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _five_bits(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """A Q5_0 / Q5_1 block's 4 bytes of fifth bits and 16 of nibbles -> q [..., 32] 0..31."""
    low = np.concatenate([qs & 0x0F, qs >> 4], -1)
    high = np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")
    return low | (high << 4)


def file_parts(data: np.ndarray, type_name: str):
    """A GGUF tensor's rows as the file holds them (uint8 [N, blocks x bytes]) of a FILE_TYPES
    type -> (kind, d, m or None, q): BlockWeight's parts holding the same values (scales as
    float32, exact; the tile keeps each kind's SCALE_DTYPE, also exact). Q4_0 comes as
    Q4_1 with m = -8d and Q5_0 as Q8_0 with q - 16 (both exact); a K-quant's sub-blocks' scales
    multiplied out in float32 (exact). In a Q4 block byte j holds weight j low and j + 16 high."""
    if type_name not in FILE_BLOCK:
        raise ValueError(f"{type_name} blocks are not held as they are; "
                         f"{', '.join(FILE_TYPES)} are")
    rows = np.ascontiguousarray(data)
    N = rows.shape[0]
    size = FILE_BLOCK[type_name][0]
    b = rows.reshape(N, -1, size)                                       # [N, blocks, bytes]
    if type_name == "Q8_0":                         # q a view: _tile copies it a chunk at a time
        return Q8_0, _f16(b[..., 0:2]), None, b[..., 2:].view(np.int8)
    if type_name in ("Q4_0", "Q4_1"):               # -8d: exact (a power of two)
        d = _f16(b[..., 0:2])
        m = -8 * d if type_name == "Q4_0" else _f16(b[..., 2:4])
        nibbles = b[..., size - 16:]
        return Q4_1, d, m, np.concatenate([nibbles & 0x0F, nibbles >> 4], -1)
    if type_name == "Q5_0":
        q = _five_bits(b[..., 2:6], b[..., 6:22]).astype(np.int8) - np.int8(16)
        return Q8_0, _f16(b[..., 0:2]), None, q
    if type_name == "Q5_1":
        d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        return U8, np.repeat(d, 2, 1), np.repeat(m, 2, 1), _five_bits(b[..., 4:8], b[..., 8:24])
    G = b.shape[1] * 8                                                   # blocks of 32
    if type_name == "Q6_K":
        ql = b[..., :128].reshape(N, -1, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]
        ql = (ql & 0x0F).reshape(N, -1, 8, 32)
        qh = b[..., 128:192].reshape(N, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
        qh = (qh & 0x03).reshape(N, -1, 8, 32)
        q = (ql | (qh << 4)).reshape(N, G, 32)                                      # 0..63
        s = (_f16(b[..., 208:210])[..., None] *
             b[..., 192:208].copy().view(np.int8).astype(np.float32)).reshape(N, 2 * G)
        return U8, s, -32 * s, q
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])                        # [N, supers]
    sc, mn = _k_scales(b[..., 4:16])                                     # [N, supers, 8]
    s = (d[..., None] * sc).reshape(N, G)
    m = -(dmin[..., None] * mn).reshape(N, G)
    ql = b[..., size - 128:].reshape(N, -1, 4, 1, 32) >> np.array([0, 4], np.uint8)[:, None]
    q = (ql & 0x0F).reshape(N, G, 32)
    if type_name == "Q4_K":
        return Q4_K, s, m, q
    qh = b[..., 16:48].reshape(N, -1, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]
    q = q | ((qh & 0x01).reshape(N, G, 32) << 4)                                    # 0..31
    return U8, np.repeat(s, 2, 1), np.repeat(m, 2, 1), q


def from_file_blocks(data: np.ndarray, type_name: str) -> BlockWeight:
    """A GGUF tensor's rows as the file holds them, of a FILE_TYPES type: the same values in
    the kind that holds them (file_parts), tiled CHUNK rows at a time. Where `data` is mapped
    from the file (np.memmap), each chunk's pages are handed back once it is tiled: mapped file
    pages count in the process's memory until then, and a 49152-row head's were 34 MB of the
    load's peak (with its parts unpacked whole, another 28 for a Q4 head)."""
    N, tiles = data.shape[0], None
    for r in range(0, N, CHUNK):
        kind, d, m, q = file_parts(data[r:r + CHUNK], type_name)
        if tiles is None:
            tiles = np.empty((-(-N // TR), q.shape[1], TILE_BYTES[kind]), np.uint8)
        tiles[r // TR:(r + CHUNK) // TR] = _tile_rows(kind, d, m, q)
        del d, m, q
        _hand_back(data, r, min(r + CHUNK, N))
    return BlockWeight.from_tiles(kind, tiles, N, source=type_name)


def _hand_back(data: np.ndarray, r0: int, r1: int) -> None:
    """Drop the pages of rows r0..r1 of an array mapped read-only from a file from this process
    (MADV_DONTNEED: they stay in the page cache, and a later read maps them again; a read-only
    mapping has no writes to lose). Nothing for other arrays."""
    import mmap

    owner = data                          # np.asarray(memmap) is a view whose base holds it
    while getattr(owner, "_mmap", None) is None and getattr(owner, "base", None) is not None:
        owner = owner.base
    pages = getattr(owner, "_mmap", None)
    if pages is None or getattr(owner, "mode", None) != "r" or not hasattr(pages, "madvise") \
            or not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = data.ctypes.data - np.frombuffer(pages, np.uint8, 1).ctypes.data + r0 * data.strides[0]
    end = start + (r1 - r0) * data.strides[0]
    start = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE        # whole pages inside the rows only
    end = end // mmap.PAGESIZE * mmap.PAGESIZE
    if end > start:
        pages.madvise(mmap.MADV_DONTNEED, start, end - start)


def reorder_rows(w: BlockWeight, order: torch.Tensor) -> BlockWeight:
    """The same weight with its rows in `order` (a row's blocks move with it)."""
    d, m, q = w.parts()
    idx = order.numpy()
    return BlockWeight(w.kind_code, d[idx], None if m is None else m[idx], q[idx],
                       w.group_size, w.source)


def common_kind(kinds) -> int:
    """The one kind that holds weights of `kinds` exactly (_as_kind)."""
    kinds = set(kinds)
    if len(kinds) == 1:
        return kinds.pop()
    return Q4_K if kinds <= {Q4_1, Q4_K} else U8


def stack(weights: list[BlockWeight]) -> BlockWeight:
    """Weights of one width stacked along their rows (q/k/v, gate/up), in the kind that holds
    them all (common_kind)."""
    if len(weights) == 1:
        return weights[0]
    kind = common_kind(w.kind_code for w in weights)
    parts = [_as_kind(w.kind_code, kind, *w.parts()) for w in weights]
    sources = {w.source or NAMES[w.kind_code] for w in weights}
    return BlockWeight(kind, np.concatenate([p[0] for p in parts]),
                       None if parts[0][1] is None else np.concatenate([p[1] for p in parts]),
                       np.concatenate([p[2] for p in parts]), weights[0].group_size,
                       " + ".join(sorted(sources)) if len(sources) > 1 else sources.pop())


def quantize_q4(w: torch.Tensor, group_size: int = QK) -> BlockWeight:
    """W [N, K] as Q4_1 blocks: each group of `group_size` weights (a multiple of 32) shares d =
    (max - min) / 15 and m = min, both in float16, and q = round((w - m) / d) in [0, 15]."""
    N, K = w.shape
    g = w.detach().float().reshape(N, K // group_size, group_size)                 # [N, Gg, g]
    lo, hi = g.amin(-1), g.amax(-1)
    d = ((hi - lo) / 15).to(torch.float16).float()
    d = torch.where(d > 0, d, torch.ones_like(d))          # a constant group: q = 0, value m
    m = lo.to(torch.float16).float()
    q = torch.round((g - m[..., None]) / d[..., None]).clamp_(0, 15).to(torch.uint8)
    per = group_size // QK                                 # 32-blocks per group
    return BlockWeight(Q4_1, d.to(torch.float16).repeat_interleave(per, 1).numpy(),
                       m.to(torch.float16).repeat_interleave(per, 1).numpy(),
                       q.reshape(N, K // QK, QK).numpy(), group_size)


def quantize_q8(w: torch.Tensor) -> BlockWeight:
    """W [N, K] as Q8_0 blocks: d = max |w| / 127 over each 32 (float16), q = round(w / d)."""
    N, K = w.shape
    g = w.detach().float().reshape(N, K // QK, QK)                                   # [N, G, 32]
    d = (g.abs().amax(-1) / 127).to(torch.float16).float()
    d = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.round(g / d[..., None]).clamp_(-127, 127).to(torch.int8)
    return BlockWeight(Q8_0, d.to(torch.float16).numpy(), None, q.numpy())
