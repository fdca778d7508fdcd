"""The verify pass with static shapes: what a CUDA graph captures, one graph per bucket.

A CUDA graph replays a fixed sequence of kernels on fixed buffers, so nothing in the pass may
depend on a value the host reads, and no shape may change from one replay to the next. The eager
pass (backends/hf/backend.py `run`) has two such dependencies: attention reads keys [0, kv_len), a host
int that grows with the context, and the cache writes only a ragged batch's real positions
(indices built on the host). `static_forward` has neither:

- each row's queries attend over the cache's whole capacity C, masked on the device by position
  (key j is seen by a query at position p when j <= p), so the pass costs the same at context 64
  and 1000 (on a GPU that is a fixed-size attention; on a CPU it only costs more);
- every position writes its keys and values: a real one at its place, a padding position at
  the scratch column C - 1, which no query ever sees (the cache holds max_length + 64 columns).

`StaticStep` holds one bucket's (rows, positions) input buffers, copies a plan into them and runs
the step: on a CUDA device it captures the step once as a `torch.cuda.CUDAGraph` and replays it;
elsewhere it runs the same step eagerly (the CPU tests check that path against the eager pass).
`GraphRunner` keeps one step per bucket (powers of two) and says which plans it takes: chains
and plain passes of the lean forward; trees, hidden-state captures and prefills run eagerly.
"""
from __future__ import annotations

import torch


def static_forward(lean, keys: list[torch.Tensor], values: list[torch.Tensor],
                   ids: torch.Tensor, positions: torch.Tensor, write: torch.Tensor,
                   slots: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """Logits [B, T, V] of one pass in which no shape depends on a length.

    ids, positions, write [B, T] long: the inputs, their rotary positions, and the cache column
    each one's keys and values go to (padding: the scratch column); slots [B] long: each row's
    cache row; columns [C] long: 0..C-1; keys / values: the cache's [S, Hkv, C, D] per layer."""
    x = lean.embedding(ids)                                                          # [B, T, E]
    cos, sin = lean._cos[positions][:, None], lean._sin[positions][:, None]          # [B, 1, T, D]
    mask = (columns[None, None, :] <= positions[:, :, None])[:, None]                # [B, 1, T, C]
    B, T = ids.shape
    layers, head = lean._dual if lean._dual is not None and B * T >= lean.dual_from \
        else (lean.layers, lean.lm_head)
    rows = slots[:, None]                                                            # [B, 1]

    def attend(k, v, i):     # every position written (padding: scratch), every column read
        kb, vb = keys[i], values[i]                                                  # [S, Hkv, C, D]
        kb[rows, :, write] = k.transpose(1, 2).to(kb.dtype)                          # [B, T, Hkv, D]
        vb[rows, :, write] = v.transpose(1, 2).to(vb.dtype)
        return kb.index_select(0, slots), vb.index_select(0, slots)                  # [B, Hkv, C, D]

    for i, weights in enumerate(layers):
        x = lean.layer(i, weights, x, cos, sin, mask, attend)
    return lean._normed_mm(x, lean.norm, head)                                       # [B, T, V]


class StaticStep:
    """One bucket's static input buffers and its step (a CUDA graph on a CUDA device)."""

    def __init__(self, lean, cache, rows: int, positions: int, device: torch.device,
                 capture: bool):
        self.lean, self.cache = lean, cache
        self.rows, self.positions = rows, positions
        C = cache.max_capacity
        self.scratch = C - 1
        long = {"dtype": torch.long, "device": device}
        self.ids = torch.zeros(rows, positions, **long)                              # [Bp, Tp]
        self.pos = torch.zeros(rows, positions, **long)                              # [Bp, Tp]
        self.write = torch.full((rows, positions), self.scratch, **long)             # [Bp, Tp]
        self.slots = torch.zeros(rows, **long)                                       # [Bp]
        self.columns = torch.arange(C, **long)                                       # [C]
        self.steps = torch.arange(positions, **long)                                 # [Tp]
        self.graph = None
        self.out = None
        if capture:
            self._capture()

    def _args(self):
        return (self.lean, self.cache.keys, self.cache.values, self.ids, self.pos, self.write,
                self.slots, self.columns)

    def _capture(self) -> None:
        """Warm up on a side stream (the buffers write only the scratch column), then capture."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                static_forward(*self._args())
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = static_forward(*self._args())

    def load(self, plan) -> None:
        """Copy a plan (padded to this bucket) into the static buffers, on the device."""
        lens = torch.as_tensor(plan.lens, device=self.ids.device)                    # [Bp] (H2D)
        real = self.steps[None, :] < lens[:, None]                                   # [Bp, Tp]
        self.ids.copy_(plan.input_ids)
        self.pos.copy_(plan.positions)
        self.write.copy_(torch.where(real, plan.write_positions, self.scratch))
        self.slots.copy_(plan.slots)

    def __call__(self, plan) -> torch.Tensor:
        """Logits [Bp, Tp, V] of the plan; the caller reads its real rows and positions."""
        self.load(plan)
        if self.graph is None:
            return static_forward(*self._args())
        self.graph.replay()
        return self.out.clone()         # the next replay overwrites the static output


def pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class GraphRunner:
    """Static steps per (rows, positions) bucket for one backend's lean forward and cache."""

    def __init__(self, lean, cache, device: torch.device, max_rows: int, max_positions: int,
                 capture: bool | None = None):
        self.lean, self.cache, self.device = lean, cache, device
        self.max_rows, self.max_positions = pow2(max_rows), pow2(max_positions)
        self.capture = device.type == "cuda" if capture is None else capture
        self.steps: dict[tuple[int, int], StaticStep] = {}
        self.capture_seconds = 0.0
        # the rotary table reaches the whole capacity now: an eager pass never regrows it (a
        # captured graph holds the table's address)
        lean._rope(torch.zeros(1, 1, dtype=torch.long, device=device), lean.embed.dtype,
                   cache.max_capacity)
        for layer in range(cache.num_layers):      # the cache's buffers exist before a capture
            cache._ensure(layer, torch.zeros(1, lean.num_kv_heads, 1, lean.head_dim,
                                             dtype=lean.embed.dtype, device=device))

    def bucket(self, rows: int, positions: int) -> tuple[int, int]:
        """The padded sizes a plan runs at: powers of two (exact sizes past the largest bucket,
        which then run eagerly)."""
        Bp, Tp = pow2(rows), pow2(positions)
        if Bp > self.max_rows or Tp > self.max_positions:
            return rows, positions
        return Bp, Tp

    def takes(self, plan, hidden_layers, logits: bool) -> bool:
        """Chains and plain passes of bucket sizes; trees, hidden states and prefill (no
        logits) run eagerly."""
        Bp, Tp = plan.shape
        return (plan.tree is None and logits and not hidden_layers
                and Bp == pow2(Bp) <= self.max_rows and Tp == pow2(Tp) <= self.max_positions)

    def run(self, plan) -> torch.Tensor:
        """Logits [B, T, V] float32 of the plan's real rows and positions; commits its lengths."""
        import time

        step = self.steps.get(plan.shape)
        if step is None:
            start = time.perf_counter()
            step = self.steps[plan.shape] = StaticStep(
                self.lean, self.cache, *plan.shape, self.device, self.capture)
            self.capture_seconds += time.perf_counter() - start
        self.cache.begin(plan)
        out = step(plan)
        self.cache.commit(plan.slot_list, plan.lens)
        return out[:plan.rows, :plan.width].float()                                   # [B, T, V]
