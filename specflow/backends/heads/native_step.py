"""An EAGLE-3 head's draft step as two native calls (`gemv.c`), where the native kernel builds.

Eagerly a head step is ~40 torch operations (two norms and a concatenation, rotary, the cache
write, attention, residuals, SiLU, a final norm), each a few microseconds of dispatch: on a
2-core CPU they cost more than the head's bytes (the demo head reads 9 MB, ~0.3 ms; its eager
step took ~0.7 ms). Here the head's layer is one `specflow_side_layer` call, the target's
native pass (`backends/lean/native_pass.py`) with the head's side input: its q/k/v read
[RMSNorm(embedding) x input_layernorm, RMSNorm(state) x hidden_norm] (2E wide), and the final
norm and the LM head one `specflow_held` call. The weights are read as saved (float16 widened
exactly as it is read, bfloat16, float32: backends/lean/bf16_weights.py) against float32
activations, so the head computes in float32 here whatever its saved dtype. The fc that fuses
the target's states is one held product too.

A head's drafts never change what the pipeline outputs (the verifier decides), so the float32
arithmetic here (against the eager path's arithmetic in the head's dtype) changes how often a
draft is accepted at most, not the output (tests/backends/heads/test_native_step.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from specflow.backends.lean import native
from specflow.backends.lean.bf16_weights import hold
from specflow.backends.lean.native_pass import (_pointers, cache_tables, only_real,
                                                  query_rows, raise_failed)


class NativeHead:
    """A prepared head's weights held for the native calls (built once, `build`)."""

    def __init__(self, head, held: list):
        s, m = head.shape, head.midlayer
        self.fc, self.lm_head, *products = held
        self.products = products                               # q/k/v, o, gate/up, down
        self.weights = _pointers(products)
        self.kinds = torch.tensor([w.kind_code for w in products], dtype=torch.int8)
        self.norm_weights = [m.hidden_norm.weight.detach().float().contiguous(),
                             m.post_attention_layernorm.weight.detach().float().contiguous()]
        self.norms = _pointers(self.norm_weights)
        self.side_norm = m.input_layernorm.weight.detach().float().contiguous()
        self.final_norm = head.norm.weight.detach().float().contiguous()
        self.embed = (head.embed if head.embed.dtype == torch.float32
                      else head.embed.float()).contiguous()         # [V, E], read by row in C
        self.eps = float(s.rms_norm_eps)
        self.shape = s

    @classmethod
    def build(cls, head, device: torch.device, bits: int | None = None):
        """A prepared head (head.prepare()) on a CPU whose weights the native calls read; None
        elsewhere (the eager step runs). `bits` 8 or 4: the weights in GGUF's Q8_0 / Q4_1
        blocks (backends/lean/blocks.py; proposer.dtype=int8 | int4), a half or a quarter of
        float16's bytes a step reads."""
        s = head.shape
        if device.type != "cpu" or not native.available(torch.float32) \
                or s.num_attention_heads % s.num_key_value_heads or head._mm is None:
            return None
        m = head.midlayer
        weights = [head.fc.weight, head.lm_head.weight, head._wqkv, m.self_attn.o_proj.weight,
                   head._wgu, m.mlp.down_proj.weight]
        if bits is not None:
            from specflow.backends.lean.quantized import quantize_weight

            held = [quantize_weight(w.detach().float(), bits, 32) for w in weights]
        else:
            held = [hold(w) for w in weights]
        if any(not isinstance(h, native.HeldWeight) for h in held):
            return None          # a width off the blocks' 32 (ATen's layouts are not native)
        return cls(head, held)

    def layer_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """fc over concatenated target states [B, T, nE] -> [B, T, E] float32; a head state
        [B, T, E] as a float32 copy (the layer overwrites its input)."""
        if hidden.shape[-1] == self.shape.hidden_size:
            return hidden.float().clone()
        return native.held(self.fc, hidden.float())

    def layer(self, x: torch.Tensor, tokens: torch.Tensor, cache, cos: torch.Tensor,
              sin: torch.Tensor) -> torch.Tensor | None:
        """x [B, T, E] float32 (overwritten) with tokens [B, T] at the rows `cache.plan` says ->
        the layer's pre-norm output [B, T, E]; their keys and values written into the cache.
        None where the cache cannot be read this way (the eager step runs)."""
        tables = cache_tables(cache, self.shape.num_key_value_heads, self.shape.dim)
        B, T, E = x.shape
        rows = query_rows(cache, B, T) if tables is not None else None
        if rows is None:
            return None
        slots, columns, below, see, width, real = rows
        s, D = self.shape, self.shape.dim
        R = B * T
        flat, side, cos, sin = only_real(real, x.view(R, E), F.embedding(tokens, self.embed)
                                         .reshape(R, E), cos.reshape(R, D), sin.reshape(R, D))
        side, cos, sin, R = side.contiguous(), cos.contiguous(), sin.contiguous(), flat.shape[0]
        failed = native._library().specflow_side_layer(
            flat.data_ptr(), side.data_ptr(), self.side_norm.data_ptr(), R, E,
            s.num_attention_heads, s.num_key_value_heads, D, s.intermediate_size,
            self.weights, self.kinds.data_ptr(), self.norms, self.eps, tables[0], tables[1],
            cache.max_capacity, slots.data_ptr(), columns.data_ptr(), below.data_ptr(),
            None if see is None else see.data_ptr(), width, cos.data_ptr(), sin.data_ptr(),
            torch.get_num_threads())
        raise_failed(failed, "the head's native step", R, columns, cache.max_capacity)
        if real is not None:
            x.view(B * T, E).index_copy_(0, real, flat)
        return x

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [.., Vd] float32 of pre-norm states [.., E]: the final norm
        and the LM head in one call."""
        return native.held(self.lm_head, h.float(), self.final_norm, self.eps)

    def chain(self, head, states: torch.Tensor, cache, slots: list[int], steps: list[int],
              ids: torch.Tensor | None, min_confidence: float | None = None
              ) -> torch.Tensor | None:
        """Greedy steps as one native call (gemv.c's specflow_head_chain): states [R, E] each
        row's head state after its committed pairs; row r takes steps[r] drafts, each the argmax
        of the head's logits (on the target's vocabulary through `ids` [Vd] increasing, or None
        for the identity), each after the first fed back with the state before it -> [R,
        max(steps)] long (-1 past a row's steps; min_confidence: a row also stops after its
        first draft whose probability under its step's softmax is below it, that draft kept). The
        steps' keys and values are written past the cache's lengths, which stay as they are.
        None where the cache is not the native one's."""
        tables = cache_tables(cache, self.shape.num_key_value_heads, self.shape.dim)
        if tables is None:
            return None
        s, D = self.shape, self.shape.dim
        R, S, E = len(slots), max(steps, default=0), s.hidden_size
        out = torch.full((R, S), -1, dtype=torch.long)                                # [R, S]
        if S == 0:
            return out
        starts = [cache.lengths[slot] for slot in slots]
        cos, sin = head.rope_table(torch.float32, max(starts) + S)                    # [P, D]
        x = states.float().contiguous().clone()                                       # [R, E]
        numbers = torch.tensor([*slots, *starts, *steps], dtype=torch.long)
        slot_t, start_t, steps_t = numbers.split(R)
        failed = native._library().specflow_head_chain(
            x.data_ptr(), self.embed.data_ptr(), self.embed.shape[0], self.side_norm.data_ptr(),
            R, steps_t.data_ptr(), S, E, s.num_attention_heads, s.num_key_value_heads, D,
            s.intermediate_size, self.weights, self.kinds.data_ptr(), self.norms, self.eps,
            tables[0], tables[1], cache.max_capacity, slot_t.data_ptr(), start_t.data_ptr(),
            cos.data_ptr(), sin.data_ptr(), cos.shape[0], self.final_norm.data_ptr(),
            self.lm_head.data_ptr(), self.lm_head.kind_code, self.lm_head.shape[0],
            None if ids is None else ids.data_ptr(), out.data_ptr(), float(min_confidence or 0.0),
            torch.get_num_threads())
        if failed == 4:
            raise ValueError(f"a token the head drafted lies outside the embedding's "
                             f"{self.embed.shape[0]} rows")
        raise_failed(failed, "the head's native steps", R, start_t + S, cache.max_capacity)
        return out
