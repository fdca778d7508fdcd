"""A pass of a few queries through every decoder layer as one native call (`gemv.c`).

The lean forward spends about 35 torch operations per decoder layer on a pass of one to a few
positions (norms, rotary, cache writes, attention, residuals, SiLU), each a few microseconds of
Python and dispatch: on SmolLM2-135M (30 layers) about 10 ms of a 35-45 ms pass whose products
stream 538 MB in about 28 ms. `specflow_layers` runs the same sequence in C for up to
`native.MAX_ROWS` float32 queries: the products are the native product's rows, attention reads
each query's visible keys straight from the cache rows (no mask tensor: a causal row sees its
keys up to its own column, a token tree's node the committed prefix and its ancestors), and the
keys and values of the pass are written into the cache before any query attends.

It takes a pass only where its mask is the plan's own (the backend says so with
`plan_mask=True`: no sliding window past its width, no bucket padding), for float32 activations,
weights float32 dense or in GGUF blocks (`dtype=int4 | int8`, a GGUF file's Q4 blocks:
blocks.py, each product quantizing its input per block as the eager layers' block products do)
without biases, a SlotKVCache whose buffers exist, and a row count for which `kernels.pick()`
chose the native product (or, for a model held in blocks, every row count). A query's result
does not depend on the other queries of the pass or on the thread count, as the native product's
rows, and a tree node scores as the same tokens in a chain
(tests/backends/lean/test_native_pass.py); it equals the eager layers' up to float rounding (for
blocks, up to where an input's rounding moves its int8 quantization a step). A ragged batch
(rows of different lengths: a policy's per-row draft lengths) runs its real queries only; its
padding positions keep their inputs, as no caller reads them (the eager layers computed them for
nothing).
"""
from __future__ import annotations

import ctypes

import torch

from specflow.backends.lean import native


def _pointers(tensors: list[torch.Tensor]) -> ctypes.Array:
    return (ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors])


def cache_tables(cache, kv_heads: int, head_dim: int) -> tuple[ctypes.Array, ctypes.Array] | None:
    """The cache's per-layer key and value buffers as pointer tables, kept on the cache
    (SlotKVCache.native_tables: its buffers never move once allocated); None where they are not
    float32 and contiguous. A fresh cache's buffers are allocated here: left to the eager
    layers' first write, a backend's first pass would take the eager layers and a later one of
    the same tokens the native call, and the two differ by float rounding (the same prompt
    scored differently on a fresh backend and on a used one)."""
    if cache.native_tables is not None:
        return cache.native_tables
    if any(t is None for t in (*cache.keys, *cache.values)):
        cache.allocate(torch.empty(1, kv_heads, 1, head_dim))
    keys, values = cache.keys, cache.values
    if any(t is None or t.dtype != torch.float32 or not t.is_contiguous()
           for t in (*keys, *values)):
        return None
    cache.native_tables = (_pointers(keys), _pointers(values))
    return cache.native_tables


def query_rows(cache, B: int, T: int):
    """Where the queries of a pass of B x T read and write the cache (`cache.plan`), the real
    ones of a ragged batch only (padding is never read): (slots, columns, below [R] long, see
    [R, W] uint8 or None, W, real [R] flat indices or None (every query)): each query's cache
    row and column, the keys below `below` it sees, and the tree keys past them it sees. None
    where a tree's columns pass the cache (the eager mask ignores them)."""
    plan = cache.plan
    slots = plan.slots if T == 1 else plan.slots[:, None].expand(B, T)             # [B, T]
    columns = plan.write_positions                                                # [B, T]
    tree, width, see = plan.tree, 0, None
    if tree is None:                             # causal: a query sees keys 0..its column
        below = columns + 1
    else:                           # the committed prefix, and the tree keys `see` marks
        width = tree.see.shape[2]
        if max(tree.visible_below) + width > cache.max_capacity:
            return None
        below = torch.tensor(tree.visible_below)[:, None].expand(B, T)
        see = tree.see.to(torch.uint8).reshape(B * T, width)                     # [BT, W]
    real = plan.ragged[2] if plan.ragged is not None else None
    slots, columns, below, see = only_real(
        real, *(t.reshape(B * T) for t in (slots, columns, below)), see)
    return (slots.contiguous(), columns.contiguous(), below.contiguous(),
            None if see is None else see.contiguous(), width, real)


def only_real(real: torch.Tensor | None, *rows: torch.Tensor | None) -> list:
    """Each [B x T, ...] tensor's rows of a ragged batch's real queries (`real` [N] flat indices;
    padding is never read), or the tensors as they are (None stays None)."""
    if real is None:
        return list(rows)
    return [None if t is None else t.index_select(0, real) for t in rows]


def raise_failed(failed: int, what: str, R: int, columns: torch.Tensor, capacity: int) -> None:
    """A native layer call's status as one error: 1 out of memory, else a cache column past
    the cache (0: nothing to say)."""
    if failed == 1:
        raise MemoryError(f"{what} could not allocate its buffers for {R} queries")
    if failed:
        raise ValueError(f"a cache column in {columns.tolist()} or a visible key lies outside "
                         f"{what}'s KV cache ({capacity} columns)")


class NativePass:
    """Pointer tables of one LeanLlama's weights (built once; `stale()` after a re-layout) and of
    the caches it has run on."""

    def __init__(self, lean):
        self.lean = lean
        self.layers = list(lean.layers)               # the tuples the tables were built from
        self.runs = self.supported(lean)
        self.held = self.runs and self.all_held(lean)   # every product held for the native kernel
        self._at: dict[tuple[int, ...], torch.Tensor] = {}   # capture set -> _capture_slots
        if self.runs:
            products = [layer[f] for layer in lean.layers for f in (1, 3, 6, 7)]
            self.weights = _pointers(products)
            # each product's kind: 0 float32, else its GGUF block type (blocks.c)
            self.kinds = torch.tensor([0 if isinstance(w, torch.Tensor) else w.kind_code
                                       for w in products], dtype=torch.int8)
            self.norms = _pointers([layer[f] for layer in lean.layers for f in (0, 5)])

    @staticmethod
    def supported(lean) -> bool:
        """The model's layers are ones specflow_layers computes: float32 activations, products
        float32 dense and contiguous or GGUF blocks (blocks.py), no biases, heads that group
        evenly."""
        if not native.available(torch.float32) or lean.num_heads % lean.num_kv_heads \
                or lean.embed.dtype != torch.float32:
            return False
        for ln1, wqkv, bqkv, wo, bo, ln2, wgu, wdown in lean.layers:
            if bqkv is not None or bo is not None:
                return False
            for w in (ln1, wqkv, wo, ln2, wgu, wdown):
                if isinstance(w, native.HeldWeight):
                    continue
                if not isinstance(w, torch.Tensor) or w.is_mkldnn or w.dtype != torch.float32 \
                        or w.device.type != "cpu" or not w.is_contiguous():
                    return False
        return True

    @staticmethod
    def all_held(lean) -> bool:
        """Every product weight of the layers is held for the native kernel (GGUF blocks,
        bfloat16 weights): the eager layers multiply by the same native products, so the one
        call computes what they do for less."""
        return all(isinstance(layer[f], native.HeldWeight) for layer in lean.layers for f in (1, 3, 6, 7))

    def stale(self, lean) -> bool:
        """The lean forward's weights moved since the tables were built (pack(), unpack()
        replace layer tuples in place)."""
        return len(lean.layers) != len(self.layers) or any(
            now is not then for now, then in zip(lean.layers, self.layers))

    def _capture_slots(self, layers: int, wanted: tuple[int, ...]) -> torch.Tensor:
        """[layers] long: where layer i's input goes among the captured states, -1 for none
        (kept per capture set: a pass reads it, never writes it)."""
        at = self._at.get(wanted)
        if at is None:
            at = self._at[wanted] = torch.full((layers,), -1, dtype=torch.long)
            for j, i in enumerate(wanted):
                at[i] = j
        return at

    def __call__(self, x: torch.Tensor, cache, cos: torch.Tensor, sin: torch.Tensor,
                 capture: tuple[int, ...], captured: list | None,
                 head: tuple | None = None) -> torch.Tensor | None:
        """x [B, T, E] float32 (the embedded inputs, overwritten) -> the residual stream after
        the last layer [B, T, E]; None where the cache cannot be read this way (the eager
        layers run instead). cos, sin [B, 1, T, D]: the queries' rotary rows. head (the final
        norm [E], the LM head [V, E], its Kernels.fused_kind()): the logits [B, T, V] instead, computed
        in the same call, where every query is real (a ragged batch hands back its stream)."""
        tables = cache_tables(cache, self.lean.num_kv_heads, self.lean.head_dim)
        if tables is None:
            return None
        lean = self.lean
        B, T, E = x.shape
        R, L, D = B * T, len(lean.layers), lean.head_dim
        rows = query_rows(cache, B, T)
        if rows is None:
            return None
        slots, columns, below, see, width, real = rows
        whole = x
        x, cos, sin = only_real(real, x.view(R, E), cos.reshape(R, D), sin.reshape(R, D))
        cos, sin, R = cos.contiguous(), sin.contiguous(), x.shape[0]
        wanted = [i for i in sorted(capture) if i < L]
        at = self._capture_slots(L, tuple(wanted))                                   # [L]
        caps = torch.empty(len(wanted), R, E) if wanted else None                    # [n, R, E]
        intermediate = lean.layers[0][7].shape[1]                           # down [E, I]
        args = (x.data_ptr(), R, E, lean.num_heads, lean.num_kv_heads, D, intermediate, L,
                self.weights, self.kinds.data_ptr(), self.norms, lean.eps, tables[0], tables[1],
                cache.max_capacity, slots.data_ptr(), columns.data_ptr(), below.data_ptr(),
                None if see is None else see.data_ptr(), width, cos.data_ptr(), sin.data_ptr(),
                at.data_ptr(), None if caps is None else caps.data_ptr())
        logits = None
        if head is not None and real is None:
            norm, w, kind = head
            logits = torch.empty(R, w.shape[0])                                       # [R, V]
            failed = native._library().specflow_layers_head(
                *args, norm.data_ptr(), w.data_ptr(), kind, w.shape[0], logits.data_ptr(),
                torch.get_num_threads())
        else:
            failed = native._library().specflow_layers(*args, torch.get_num_threads())
        raise_failed(failed, "specflow's native pass", R, columns, cache.max_capacity)
        if real is not None:                     # back in place; padding keeps its input
            whole.view(B * T, E).index_copy_(0, real, x)
            if caps is not None:
                caps = caps.new_zeros(len(wanted), B * T, E).index_copy_(1, real, caps)
        if caps is not None:
            captured.extend(caps.view(len(wanted), B, T, E).unbind(0))              # [B, T, E] each
        return whole if logits is None else logits.view(B, T, -1)
