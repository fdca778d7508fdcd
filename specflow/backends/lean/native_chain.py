"""A draft model's greedy steps as one native call (`gemv.c`'s specflow_chain).

A greedy draft step of a small model is a few tens of microseconds of arithmetic wrapped in
about half a millisecond of Python: the plan, the pass, the LM head, the shaping call and the
argmax, each a handful of torch operations (the demo pair's draft, 2 layers of width 128: 0.34 ms
a step inside a round, 0.04 ms of it its layers). Where nothing shapes the draft's logits (a
greedy round whose shaping stages all leave the argmax alone: no penalty, bias or grammar on
its rows), the steps need no Python between them: `specflow_chain` feeds each row's uncached
committed tokens, runs the decoder layers as the native pass does (specflow_layers), the final
norm and the LM head by the same products, takes the argmax and feeds it to the next step, for
every row and step of a round in one call. Where the step path takes the native pass and the native LM-head
product too (the one-query passes of a float32 model, its usual case) the tokens are the torch
steps' bit for bit (tests/backends/lean/test_native_chain.py); where it would take other kernels
(the eager layers or a packed copy for a pass of several rows, torch's norm before a held head)
a draft can differ at a near-tie, which changes how often drafts are accepted, never the output.

It runs where the model's one-query pass is the native one (`LeanLlama._native_layers(1)`), its
embedding is a float32 table or looked up in its tied head's blocks, and its LM head is a float32
tensor or a held weight (GGUF blocks, 16-bit weights read against float32 inputs); elsewhere
`chain()` returns None and the caller takes its torch steps.
"""
from __future__ import annotations

import torch

from specflow.backends.lean import native
from specflow.backends.lean.native_pass import cache_tables, raise_failed


def head_kind(head) -> int | None:
    """The LM head as specflow_chain's product reads it: 0 a float32 tensor, a held weight's
    kind_code, None for any other layout (packed, ATen's int4, 16-bit tensors)."""
    if isinstance(head, native.HeldWeight):
        return head.kind_code
    if isinstance(head, torch.Tensor) and head.dtype == torch.float32 and not head.is_mkldnn \
            and head.device.type == "cpu" and head.is_contiguous():
        return 0
    return None


def embedding(lean) -> tuple[object, int] | None:
    """The embedding table as specflow_chain reads it: (a float32 tensor, -1), or (the tied
    head's blocks it is looked up in, their kind: quantize(share_embedding=True)); None else."""
    if lean.embed_held is not None:
        held = lean.embed_held
        return (held, held.kind_code) if hasattr(held, "rows") else None
    table = lean.embed
    if table.dtype == torch.float32 and table.is_contiguous() and table.device.type == "cpu":
        return table, -1
    return None


def _parts(lean, cache):
    """What specflow_chain reads of this model, or None where the chain cannot run its steps:
    (the native pass's tables, the cache's key and value tables, the embedding and its kind)."""
    if lean._dual is not None and lean.dual_from <= 1 or head_kind(lean.lm_head) is None:
        return None
    whole, table = lean._native_layers(1), embedding(lean)
    tables = cache_tables(cache, lean.num_kv_heads, lean.head_dim)
    if whole is None or table is None or tables is None:
        return None
    return whole, tables, table


def runs(lean, cache) -> bool:
    """The chain can run this model's steps: a native one-query pass, an embedding table and an
    LM head it reads itself, a cache the native pass reads."""
    return _parts(lean, cache) is not None


def chain(lean, cache, slots: list[int], fed: list[list[int]], steps: list[int],
          vocab_size: int, min_confidence: float | None = None) -> torch.Tensor | None:
    """Greedy steps of rows `slots` (cache rows of lengths cache.lengths): row r feeds its tokens
    fed[r] (at least one: the committed ones its cache lacks) at its cache length and takes
    steps[r] steps, each after the first feeding the token the last one found -> [R, max(steps)]
    long, each row's tokens (-1 past its steps), the argmax of each step's logits over the first
    `vocab_size` entries (min_confidence: a row also stops after its first token whose
    probability under their softmax is below it, that token kept); None where the chain does
    not run here. The cache holds the fed tokens
    afterwards (their lengths are the caller's to commit)."""
    parts = _parts(lean, cache)
    if parts is None:
        return None
    (whole, (keys, values), (table, kind)), head = parts, lean.lm_head
    R, S = len(slots), max(steps, default=0)
    out = torch.full((R, S), -1, dtype=torch.long)                                  # [R, S]
    if S == 0:
        return out
    starts = [cache.lengths[s] for s in slots]
    reach = max(n + len(f) + k for n, f, k in zip(starts, fed, steps))
    cos, sin = lean.rope_table(torch.float32, reach)                                # [P, D]
    numbers = torch.tensor([*slots, *starts, *steps, *(len(f) for f in fed),
                            *(t for f in fed for t in f)], dtype=torch.long)
    slot_t, start_t, steps_t, lens_t, fed_t = numbers.split([R, R, R, R, len(numbers) - 4 * R])
    V_in, E = table.shape
    failed = native._library().specflow_chain(
        table.data_ptr(), kind, V_in, R, fed_t.data_ptr(), lens_t.data_ptr(),
        steps_t.data_ptr(), S, E, lean.num_heads, lean.num_kv_heads, lean.head_dim,
        lean.layers[0][7].shape[1], len(lean.layers), whole.weights, whole.kinds.data_ptr(),
        whole.norms, lean.eps, keys, values, cache.max_capacity, slot_t.data_ptr(),
        start_t.data_ptr(), cos.data_ptr(), sin.data_ptr(), cos.shape[0], lean.norm.data_ptr(),
        head.data_ptr(), head_kind(head), head.shape[0], vocab_size, out.data_ptr(),
        float(min_confidence or 0.0), torch.get_num_threads())
    if failed == 4:
        raise ValueError(f"a token fed to specflow's native draft steps lies outside the "
                         f"embedding's {V_in} rows: {fed}")
    raise_failed(failed, "specflow's native draft steps", R, start_t + S, cache.max_capacity)
    return out
