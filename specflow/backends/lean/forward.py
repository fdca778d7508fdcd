"""A lean forward pass over a Llama-family checkpoint (Llama, Mistral, Qwen2), in gpt-fast's style.

transformers' module stack has a fixed cost per call on a CPU that is most of a tiny draft model's
step (docs/decisions.md, "Measured on this project's machines"), and its `F.linear` calls are
not the fastest form of a few-row product everywhere.
This is the same computation, from the same weights, as a plain sequence of tensor ops, writing
keys and values into the same SlotKVCache:

- q/k/v and gate/up projections fused, *in place*: the fused matrix is the only copy, and the
  model's own q_proj/k_proj/v_proj (gate/up) weights become views into it, so preparing costs no
  memory (`extra_bytes()` says 0) and `forward=hf` on the same backend still works;
- products through `kernels.pick()`, the form measured fastest for 1 row and for a few rows on this
  machine, dtype and weight set (CPU); F.linear on CUDA. `pack()` (chosen by
  `specflow.backends.lean.packing`) moves the projection weights into oneDNN's packed layout and frees
  the dense ones (the model's parameters keep their shapes over a one-element placeholder); the
  first call of transformers' forward on this model, or a `state_dict()`, unpacks them again, so
  packing costs no memory either, but for a head tied to the embedding, packed as a copy (the
  embedding table's bytes once more: the lookup reads the dense one). `pack(keep_dense=True)`
  keeps both layouts instead (a draft model's choice: its weights once more), and each pass
  takes the packed one from `dual_from` product rows up;
- rotary cos/sin from a table grown on demand, fp32 RMSNorm fused where the dtype allows, keys and
  values read from the cache as views when the batch's slots are contiguous, GQA without copies.

Results match transformers' forward up to float rounding. With `forward: auto` (the default)
specflow uses it for targets and drafts alike wherever the architecture allows; `forward=hf` keeps
transformers' forward (exactly what `generate()` computes). Exactness does not depend on the
choice: plain and speculative decoding run the same forward, and a position's logits inside a
k+1-position pass equal its logits scored alone up to rounding (tests/backends/lean/test_lean_forward.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import dataclasses

from specflow.backends.lean import bf16_weights, huge_pages, native
from specflow.backends.lean.kernels import Kernels, grouped_attention, pack, pick, \
    pick_one_query_attention
from specflow.backends.lean.native_pass import NativePass

SUPPORTED = {"llama", "mistral", "qwen2"}


def unsupported_reason(config) -> str | None:
    """None when the lean forward computes exactly what transformers' does for this config."""
    if config.model_type not in SUPPORTED:
        return f"model_type={config.model_type} (lean forward: {', '.join(sorted(SUPPORTED))})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act={config.hidden_act}"
    scaling = getattr(config, "rope_scaling", None) or {}
    kind = scaling.get("rope_type", scaling.get("type", "default")) if isinstance(scaling, dict) else "default"
    if kind not in ("default", None):
        return f"rope_scaling={kind}"
    if getattr(config, "mlp_bias", False):
        return "mlp_bias"
    if config.model_type == "qwen2" and getattr(config, "use_sliding_window", False):
        return "use_sliding_window (per-layer windows)"    # Mistral's one window: in the mask
    return None


def placeholder(shape, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of `shape` that owns one element (every stride 0): a weight held elsewhere (a
    quantized or packed layout, a GGUF file's blocks), what its module keeps meanwhile."""
    return torch.zeros((), dtype=dtype).expand(shape)


def is_placeholder(t: torch.Tensor) -> bool:
    return t.numel() > 1 and not any(t.stride())


def fuse_in_place(modules: list, attr: str = "weight") -> torch.Tensor | None:
    """One tensor holding the modules' `attr` stacked on dim 0; each module's parameter becomes a
    view into it, so the old storages are freed and nothing is held twice. Placeholders (weights
    held elsewhere, every stride 0: backends/hf/file_products.py) stack into one, owning
    nothing."""
    parts = [getattr(m, attr) for m in modules]
    if any(p is None for p in parts):
        return None
    if all(is_placeholder(p) for p in parts):
        return placeholder((sum(p.shape[0] for p in parts), *parts[0].shape[1:]), parts[0].dtype)
    fused = torch.cat([p.detach() for p in parts])
    offset = 0
    for module, part in zip(modules, parts):
        rows = part.shape[0]
        getattr(module, attr).data = fused[offset:offset + rows]
        offset += rows
    return fused


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [..., D] (halves rotated, as Llama's rotate_half)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def _gqa_in_sdpa() -> bool:
    try:
        q = torch.zeros(1, 2, 1, 4)
        kv = torch.zeros(1, 1, 3, 4)
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
        return True
    except (TypeError, RuntimeError):
        return False


def first_rows(w, n: int):
    """The first n rows of a weight W [N, K] as its layout holds them, sharing its memory: a
    dense tensor's rows, or a held weight's own cut (HeldWeight.first_rows); None where the
    layout cannot be cut so (oneDNN's packed rows, ATen's packed int4, n off a tile's rows)."""
    if isinstance(w, torch.Tensor):
        return None if w.is_mkldnn or w.dim() != 2 else w[:n]
    cut = getattr(w, "first_rows", None)
    return None if cut is None else cut(n)


class LeanLlama:
    def __init__(self, model, kernels: Kernels | None = None,
                 quantize: tuple | None = None, huge_pages: bool = False):
        cfg = model.config
        inner = model.model
        self.model = model
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.eps = cfg.rms_norm_eps
        self.embed = inner.embed_tokens.weight
        # a tied embedding read from the LM head's blocks (quantize(share_embedding=True)):
        # then self.embed is a placeholder of the table's shape and dtype
        self.embed_held = None
        rotary = inner.rotary_emb
        self.inv_freq = rotary.inv_freq                                   # [D/2]
        self.rope_scale = float(getattr(rotary, "attention_scaling", 1.0))
        self._cos = self._sin = None                                       # [P, D] tables
        self.gqa = self.num_kv_heads != self.num_heads
        self.gqa_in_sdpa = self.gqa and _gqa_in_sdpa()
        self.layers = []
        with torch.no_grad():
            for layer in inner.layers:
                att, mlp = layer.self_attn, layer.mlp
                qkv = [att.q_proj, att.k_proj, att.v_proj]
                self.layers.append((
                    layer.input_layernorm.weight,
                    fuse_in_place(qkv),
                    fuse_in_place(qkv, "bias"),
                    att.o_proj.weight,
                    att.o_proj.bias,                  # Llama with attention_bias=True has one
                    layer.post_attention_layernorm.weight,
                    fuse_in_place([mlp.gate_proj, mlp.up_proj]),
                    mlp.down_proj.weight,
                ))
        self.norm = inner.norm.weight
        self.lm_head = model.lm_head.weight
        self._whole_head = None            # the LM head before first_tokens() cut it
        self.fused_norm = hasattr(F, "rms_norm")
        self._packs: list[tuple[int, int, list]] = []     # (layer, field, modules sharing it)
        self._hooks: list = []
        self.quantized: tuple[int, int] | None = None    # (bits, group size) after quantize()
        self._dual: tuple[list[tuple], torch.Tensor] | None = None
        # int8/int4 (bits, group size, activation dtype): the product weights held so before
        # the dense forms are timed (those left dense, a shape the layout cannot hold, are
        # listed here)
        self.quantized_left = self.quantize(*quantize) if quantize is not None else []
        # bytes of weights moved into 2 MB pages (huge_pages.py), before the products are timed;
        # kept there across pack() and unpack() (_keep_in_huge_pages)
        self._huge, self.huge_page_bytes = huge_pages, 0
        if huge_pages:
            self.huge_page_bytes = self._into_huge_pages()
        # one-query passes attend with grouped products from this many keys (rows x cached
        # length; None: always the fused kernel); measured, CPU float16/bfloat16 only (kernels.py)
        self.grouped_from = pick_one_query_attention(self.num_heads, self.num_kv_heads,
                                                     self.head_dim, self.embed.dtype,
                                                     self.embed.device)
        dense = self._dense_weights()
        self.kernels = kernels or (pick(dense) if dense else Kernels())
        self.mm = self.kernels.matmul
        # both layouts (pack(keep_dense=True)): packed copies of the layers and head (_dual),
        # used by passes of at least `dual_from` product rows (B x T); smaller ones keep the
        # dense forms
        self.dual_from = 1
        self._native_pass = None          # NativePass over self.layers (built on first use)
        # which passes run as one native call: None where the native product won the pick for
        # their row count, True every one it can run, False none (backends/lean/native_choice.py)
        self.native_layers: bool | None = None

    # the fields of a layer tuple that are product weights, and the modules each one feeds
    _PRODUCTS = {1: ("self_attn", ("q_proj", "k_proj", "v_proj")), 3: ("self_attn", ("o_proj",)),
                 6: ("mlp", ("gate_proj", "up_proj")), 7: ("mlp", ("down_proj",))}
    HEAD = -1                                              # the layer index of the LM head

    def _weights(self) -> list[torch.Tensor]:
        return [layer[f] for layer in self.layers for f in self._PRODUCTS] + [self.lm_head]

    def _dense_weights(self) -> list[torch.Tensor]:
        """The product weights neither packed nor quantized: those the product forms serve."""
        return [w for w in self._weights() if isinstance(w, torch.Tensor) and not w.is_mkldnn]

    def _into_huge_pages(self) -> int:
        """Copy the weights (the layers' products, dense or held in blocks, norms and
        biases; the LM head, the embedding and the final norm) into one mapping of transparent
        huge pages (huge_pages.py) and point everything that read each old one at its copy (the
        layer tuples, held weights, the model's parameters, views into fused weights included)
        before the next is copied, so that nothing holds the old ones once all are copied
        (their memory goes back to the system) -> the bytes moved (0 where huge pages are not
        available, the weights are not on a CPU, or they fill less than one huge page). The
        values are the same, bit for bit."""
        if self.embed.device.type != "cpu":
            return 0
        held: dict[int, list] = {}     # data_ptr -> the HeldWeights holding that tensor
        old: dict[int, torch.Tensor] = {}    # tensors to copy, by their data_ptr
        # every tensor of the layers (norms and biases too: a weight file mapped whole stays
        # resident while any tensor of it lives), the head, the embedding, the final norm
        every = [w for layer in self.layers for w in layer] + [self.lm_head, self.embed, self.norm]
        for w in every:
            if isinstance(w, native.HeldWeight):
                held.setdefault(w.data.data_ptr(), []).append(w)
                w = w.data
            if isinstance(w, torch.Tensor) and not w.is_mkldnn and w.device.type == "cpu" \
                    and w.is_contiguous() and not is_placeholder(w) and w.numel() > 1:
                old.setdefault(w.data_ptr(), w)
        del every, w
        sizes = [t.numel() * t.element_size() for t in old.values()]
        rooms, moved = huge_pages.reserve(sizes), sum(sizes)
        if rooms is None:
            if not self.huge_page_bytes:
                return 0
            # what is left of a mapping (less than a huge page: norms, say) into ordinary
            # memory, so that the mapping and the weights it held go
            rooms, moved = [torch.empty(size, dtype=torch.uint8) for size in sizes], 0
        # the model's parameters that may view a weight (walked once: a model has hundreds)
        params = [p for p in self.model.parameters() if p.device.type == "cpu"
                  and p.is_contiguous() and not is_placeholder(p)]
        for room, at in zip(rooms, list(old)):
            t = old.pop(at)
            copy = huge_pages.place(room, t)
            self._point_at(t, copy, held.get(at, ()), params)
            del t
        huge_pages.return_freed()
        return moved

    def _keep_in_huge_pages(self) -> None:
        """After a re-layout (pack(), unpack()): the dense weights left, or back, into a fresh
        mapping, so that the old one (whose pages still held the replaced weights) is freed and
        a dense weight unpacked into ordinary pages is in huge ones again."""
        if self._huge:
            self.huge_page_bytes = self._into_huge_pages()

    def _point_at(self, t: torch.Tensor, copy: torch.Tensor, held, params: list) -> None:
        """Everything that reads weight t reads its copy instead: held weights over it, the
        layer tuples, the head, the embedding, the final norm, and those of the model's
        `params` inside t's bytes (a fused weight's views, a tied head: the same view of the
        copy)."""
        at, end, size = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), t.element_size()

        def moved(w):
            return copy if isinstance(w, torch.Tensor) and not w.is_mkldnn \
                and w.data_ptr() == at and w.shape == t.shape and w.dtype == t.dtype else w

        for w in held:
            w.data = copy
        self.layers[:] = [tuple(moved(w) for w in layer) for layer in self.layers]
        self.lm_head, self.embed, self.norm = moved(self.lm_head), moved(self.embed), \
            moved(self.norm)
        with torch.no_grad():
            for p in params:
                if p.dtype == t.dtype and at <= p.data_ptr() \
                        and p.data_ptr() + p.numel() * size <= end:
                    first = (p.data_ptr() - at) // size
                    p.data = copy.view(-1)[first:first + p.numel()].view(p.shape)

    def _owners(self, index: int, field: int) -> list:
        if index == self.HEAD:
            return [self.model.lm_head]
        part, names = self._PRODUCTS[field]
        block = getattr(self.model.model.layers[index], part)
        return [getattr(block, name) for name in names]

    def pack(self, keep_dense: bool = False, from_rows: int = 1) -> None:
        """Pack every product weight for oneDNN and free the dense one: each owning module's
        weight becomes a one-element placeholder of the same shape, and a forward pre-hook on it
        (and a state_dict pre-hook on it and on the model) unpacks before anything reads the
        placeholder. A head tied to the embedding is packed as a copy (the embedding lookup
        reads the dense table): the one weight packing holds twice, worth it because the head is
        the widest product of a pass (a quarter of the demo target's weights; for 17 rows oneDNN
        reads it in half MKL's time). Idempotent; CPU only.

        keep_dense: keep the dense weights too and pack copies, used by passes of `from_rows`
        product rows (B x T) or more: one-row steps stay on MKL's dense products (faster there)
        and wider ones take oneDNN, for the weights' memory once more (a draft model's choice:
        a draft is small, and it steps one row in a chain but a frontier in a tree)."""
        if self._packs or self._dual is not None or self.embed.device.type != "cpu":
            return
        if keep_dense:
            with torch.no_grad():
                layers = [tuple(pack(w) if f in self._PRODUCTS else w for f, w in enumerate(layer))
                          for layer in self.layers]
                self._dual = (layers, pack(self.lm_head))
            self.dual_from = max(1, int(from_rows))
            return
        with torch.no_grad():
            for i, layer in enumerate(self.layers):
                fields = list(layer)
                for f in self._PRODUCTS:
                    fields[f] = self._pack_one(fields[f], self._owners(i, f))
                    self._packs.append((i, f, self._owners(i, f)))
                self.layers[i] = tuple(fields)
            if self.lm_head.data_ptr() != self.embed.data_ptr():
                self.lm_head = self._pack_one(self.lm_head, self._owners(self.HEAD, 0))
                self._packs.append((self.HEAD, 0, self._owners(self.HEAD, 0)))
            else:          # tied: the embedding lookup reads the dense table, so a packed copy
                self.lm_head = pack(self.lm_head)
                self._packs.append((self.HEAD, 0, []))
        self._hook_unpack()
        self.kernels = dataclasses.replace(self.kernels, pack=True)
        self.mm = self.kernels.matmul
        self._keep_in_huge_pages()

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] -> [..., E]: the embedding table's rows (or the held head's, which are
        the same values: quantize(share_embedding=True))."""
        if self.embed_held is not None:
            return self.embed_held.rows(ids).to(self.embed.dtype)
        return F.embedding(ids, self.embed)

    def quantize(self, bits: int, group_size: int = 32,
                 activations: torch.dtype | None = None, given: dict | None = None,
                 head_bits: int | None = None, share_embedding: bool = False,
                 bf16_dot: bool = False, half: torch.dtype = torch.bfloat16) -> list[str]:
        """Hold every product weight (the layers' and the LM head) in `bits` bits (GGUF blocks where the
        native kernel builds, backends/lean/blocks.py; else ATen's layouts,
        backends/lean/quantized.py) and free the dense ones, as pack() does: the owning modules
        keep one-element placeholders, and a forward or state_dict of the model unpacks first
        (to the dequantized values: the model is the quantized one from now on). A head tied to
        the embedding is quantized as a copy (the lookup reads the dense table). Returns the
        weights the layout cannot hold (int4: a shape off its tiles), which stay dense.
        `activations`: the dtype the rest of the model (embedding, norms, biases, dense
        leftovers) is cast to afterwards, which every product then reads and writes (bfloat16:
        ATen's fast weight-only paths). `given`: {(layer, field): QuantizedWeight or
        BlockWeight} held as they are instead (a GGUF file's blocks:
        backends/lean/gguf_blocks.py; field (HEAD, 0): the LM head); `head_bits`: the LM head's
        bits where they differ. `share_embedding`: a tied embedding whose values are the given
        head's (a GGUF file's tied table: its own blocks) is looked up in the head's blocks and
        its dense table freed (checked on rows across the vocabulary first, bit for bit; else
        kept). 16 bits: `half` weights, bfloat16 or float16 (bf16_weights.py); `bf16_dot`:
        bfloat16 by the CPU's bfloat16 products where it has them (Bf16Tiles), not read
        against float32 inputs. CPU only; before any pack()."""
        from specflow.backends.lean.quantized import quantize_weight

        if self._packs or self._dual is not None:
            raise RuntimeError("quantize() runs on dense weights, before pack()")
        left = []
        with torch.no_grad():
            for i, layer in enumerate(self.layers):
                fields = list(layer)
                for f in self._PRODUCTS:
                    held = (given or {}).get((i, f)) or quantize_weight(fields[f], bits,
                                                                        group_size, bf16_dot,
                                                                        half)
                    if held is None:
                        left.append(f"layer {i} {'/'.join(self._PRODUCTS[f][1])}")
                        continue
                    self._release(self._owners(i, f))
                    fields[f] = held
                    self._packs.append((i, f, self._owners(i, f)))
                self.layers[i] = tuple(fields)
            held = (given or {}).get((self.HEAD, 0)) or \
                quantize_weight(self.lm_head, head_bits or bits, group_size, bf16_dot, half)
            if held is None:
                left.append("lm_head")
            elif self.lm_head.data_ptr() != self.embed.data_ptr():
                self._release(self._owners(self.HEAD, 0))
                self._packs.append((self.HEAD, 0, self._owners(self.HEAD, 0)))
                self.lm_head = held
            else:             # tied: the embedding lookup reads the dense table
                self._packs.append((self.HEAD, 0, []))
                self.lm_head = held
                if share_embedding and (self.HEAD, 0) in (given or {}):
                    self._share_embedding(held)
        self._hook_unpack()
        self.quantized = (bits, group_size)
        if activations is not None and activations != self.embed.dtype:
            self._cast(activations)
        return left

    def _share_embedding(self, head) -> None:
        """The embedding looked up in the tied head's blocks, its table freed, where the
        blocks' rows equal the table's (bit for bit, 257 rows across the vocabulary)."""
        V = self.embed.shape[0]
        probe = torch.unique(torch.linspace(0, V - 1, 257).long())
        if not hasattr(head, "rows") or not torch.equal(head.rows(probe),
                                                        self.embed[probe].float()):
            return
        self.embed_held = head
        self._release([self.model.get_input_embeddings()])

    def _cast(self, dtype: torch.dtype) -> None:
        """The model's float parameters in `dtype` (placeholders stay one element), and the
        lean forward's own tensors (fused biases, dense leftovers) with them."""
        with torch.no_grad():
            for p in self.model.parameters():
                if not p.is_floating_point():
                    continue
                if is_placeholder(p):
                    p.data = placeholder(p.shape, dtype)
                else:
                    p.data = p.data.to(dtype)
            self.layers = [tuple(t.to(dtype) if isinstance(t, torch.Tensor) else t
                                 for t in layer) for layer in self.layers]
            if isinstance(self.lm_head, torch.Tensor):
                self.lm_head = self.lm_head.to(dtype)

    def _hook_unpack(self) -> None:
        unpack = lambda *_: self.unpack()                      # noqa: E731
        for _, _, modules in self._packs:
            for m in modules:
                self._hooks += [m.register_forward_pre_hook(unpack),
                                m.register_state_dict_pre_hook(unpack)]
        self._hooks.append(self.model.register_state_dict_pre_hook(unpack))

    @staticmethod
    def _release(modules: list) -> None:
        """The modules' weights become one-element placeholders of the same shape."""
        for m in modules:
            m.weight.data = placeholder(m.weight.shape, m.weight.dtype)

    @staticmethod
    def _pack_one(dense: torch.Tensor, modules: list) -> torch.Tensor:
        packed = pack(dense)
        LeanLlama._release(modules)
        return packed

    @property
    def packed(self) -> bool:
        """Some passes run on packed weights (all of them, or the wide ones of a dual layout)."""
        return (bool(self._packs) and self.quantized is None) or self._dual is not None

    @property
    def dual(self) -> bool:
        """Both layouts are held: passes of dual_from product rows or more run packed."""
        return self._dual is not None

    @property
    def _tied_copy(self) -> bool:
        """The head is a packed copy of the embedding table (a pack entry with no owners)."""
        return any(not modules for _, _, modules in self._packs)

    def first_tokens(self, n: int) -> bool:
        """Score only the first n token ids from now on: the LM head's first n rows (n rounded
        up to a multiple of 16, the block layouts' tiles), as its layout holds them, sharing its
        memory. For a draft that proposes among the vocabulary's first n ids only (proposer=self's
        draft_vocab): its logits [..., n]. False where the layout cannot be cut so (ATen's
        packed int4, oneDNN's packed rows, a separate layout for many rows), the head unchanged.
        unpack() restores the whole head."""
        n = -(-n // 16) * 16
        head = self._whole_head if self._whole_head is not None else self.lm_head
        if n >= head.shape[0]:
            return True
        cut = None if self._dual is not None else first_rows(head, n)
        if cut is None:
            return False
        self._whole_head, self.lm_head = head, cut
        return True

    def unpack(self) -> None:
        """Dense weights back in the modules (views into the fused tensors, as before packing),
        the packed copies dropped, and dense product forms picked: transformers' forward runs
        on this model again. Idempotent."""
        if self._whole_head is not None:           # first_tokens()' cut undone
            self.lm_head, self._whole_head = self._whole_head, None
        self._dual = None
        if not self._packs:
            return
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        with torch.no_grad():
            for index, field, modules in self._packs:
                if not modules:            # a tied head's packed copy: the embedding is the head
                    if self.embed_held is not None:       # the table back from the blocks
                        self.embed.data = self.embed_held.dequantize().to(self.embed.dtype)
                        self.embed_held = None
                    self.lm_head = self.embed
                    continue
                held = self.lm_head if index == self.HEAD else self.layers[index][field]
                dense = held.to_dense() if held.is_mkldnn else \
                    held.dequantize().to(self.embed.dtype)
                offset = 0
                for m in modules:
                    rows = m.weight.shape[0]
                    m.weight.data = dense[offset:offset + rows]
                    offset += rows
                if index == self.HEAD:
                    self.lm_head = dense
                else:
                    fields = list(self.layers[index])
                    fields[field] = dense
                    self.layers[index] = tuple(fields)
        self._packs = []
        self.quantized = None
        self.kernels = dataclasses.replace(self.kernels, pack=False)
        self.mm = self.kernels.matmul
        self._keep_in_huge_pages()

    def repick(self) -> None:
        """Pick the product forms again (the thread count changed; cached per thread count).
        Packed weights stay packed (they always take oneDNN); the dense forms are chosen again,
        timed on the dense weights left, or on the embedding table when every product is packed
        (a tied head's dense copy: what an unpacked pass multiplies)."""
        dense = self._dense_weights()
        if not dense and self._tied_copy and self.embed_held is None:
            dense = [self.embed]
        again = pick(dense) if dense else self.kernels
        self.kernels = dataclasses.replace(again, pack=self.packed)
        self.mm = self.kernels.matmul

    def extra_bytes(self) -> int:
        """Bytes this forward holds beyond what the model's parameters held at load (0 but the
        rotary table: fused weights share the model's storage, and a packed weight replaces the
        dense one, whose bytes were freed; oneDNN's blocked layout may pad a few rows), except a
        tied head's packed copy: the embedding table's bytes once more."""
        own = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        own |= {b.untyped_storage().data_ptr() for b in self.model.buffers()}
        seen, extra = set(), 0
        tensors = [t for layer in self.layers for t in layer if t is not None]
        tensors += [self.embed, self.norm, self.lm_head]
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.is_mkldnn:  # replaces a dense weight
                continue
            ptr = t.untyped_storage().data_ptr()
            if ptr not in own and ptr not in seen:
                seen.add(ptr)
                extra += t.untyped_storage().nbytes()
        if self._tied_copy and self.embed_held is None:  # the head's copy of the table
            extra += self.lm_head.nbytes() if self.quantized is not None \
                else self.embed.numel() * self.embed.element_size()
        if self._dual is not None:                                 # the packed copies
            layers, head = self._dual
            extra += sum(layer[f].numel() * layer[f].element_size()
                         for layer in layers for f in self._PRODUCTS)
            extra += head.numel() * head.element_size()
        return extra

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.fused_norm and x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), w, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return w * x32.to(x.dtype)

    def _normed_mm(self, x: torch.Tensor, norm: torch.Tensor, w) -> torch.Tensor:
        """RMSNorm(x) * norm times W^T: one native call where the product is the native one."""
        out = self.kernels.normed_matmul(x, norm, self.eps, w)
        return out if out is not None else self.mm(self._rms(x, norm), w)

    def rope_table(self, dtype, needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary tables cos, sin [P, D] (contiguous), grown to at least `needed` rows."""
        if self._cos is None or self._cos.shape[0] < needed or self._cos.dtype != dtype:
            rows = max(256, 1 << (needed - 1).bit_length())
            freqs = torch.arange(rows, device=self.inv_freq.device).float()[:, None] * self.inv_freq
            emb = torch.cat([freqs, freqs], -1)                                       # [P, D]
            self._cos = (emb.cos() * self.rope_scale).to(dtype)
            self._sin = (emb.sin() * self.rope_scale).to(dtype)
        return self._cos, self._sin

    def _rope(self, positions: torch.Tensor, dtype, needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, 1, T, D] at `positions` [B, T], from a table grown to `needed` rows."""
        cos, sin = self.rope_table(dtype, needed)                                     # [P, D]
        at, shape = positions.reshape(-1), (positions.shape[0], 1, *positions.shape[1:], -1)
        return cos.index_select(0, at).view(shape), sin.index_select(0, at).view(shape)

    def layer(self, i: int, weights: tuple, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              mask: torch.Tensor | None, attend) -> torch.Tensor:
        """Decoder layer i over x [B, T, E] -> [B, T, E]. attend(k, v, i) takes this pass's keys
        and values [B, Hkv, T, D], caches them and returns the keys and values attended
        [B, Hkv, L, D] (the eager pass: SlotKVCache.update; a static step: its own write)."""
        ln1, wqkv, bqkv, wo, bo, ln2, wgu, wdown = weights
        B, T = x.shape[:2]
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self._normed_mm(x, ln1, wqkv)                                           # [B, T, (H+2Hkv)D]
        if bqkv is not None:
            qkv = qkv + bqkv
        qk, v = qkv.split([(H + Hkv) * D, Hkv * D], -1)
        qk = rotate(qk.view(B, T, H + Hkv, D).transpose(1, 2), cos, sin)        # [B, H+Hkv, T, D]
        q, k = qk.split([H, Hkv], 1)                                                  # one rotation
        v = v.view(B, T, Hkv, D).transpose(1, 2)                                      # [B, Hkv, T, D]
        k_all, v_all = attend(k, v, i)                                                # [B, Hkv, L, D]
        if T == 1 and self.grouped_from is not None and B * k_all.shape[2] >= self.grouped_from:
            a = grouped_attention(q, k_all, v_all, mask)                              # [B, H, 1, D]
            return self._rest(x, a, wo, bo, ln2, wgu, wdown)
        if self.gqa and not self.gqa_in_sdpa:
            k_all = k_all.repeat_interleave(H // Hkv, 1)
            v_all = v_all.repeat_interleave(H // Hkv, 1)
        gqa = {"enable_gqa": True} if self.gqa_in_sdpa else {}
        a = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, **gqa)      # [B, H, T, D]
        return self._rest(x, a, wo, bo, ln2, wgu, wdown)

    def _rest(self, x: torch.Tensor, a: torch.Tensor, wo, bo, ln2, wgu, wdown) -> torch.Tensor:
        """The layer after attention: x [B, T, E], a [B, H, T, D] -> [B, T, E]."""
        B, T = x.shape[:2]
        mm = self.mm
        o = mm(a.transpose(1, 2).reshape(B, T, -1), wo)                               # [B, T, E]
        x = x + (o if bo is None else o + bo)
        gate, up = self._normed_mm(x, ln2, wgu).chunk(2, -1)                          # [B, T, I] x2
        return x + mm(F.silu(gate) * up, wdown)

    def _native_layers(self, rows: int):
        """The NativePass that runs a pass of `rows` queries, or None (the eager layers): up to
        native.MAX_ROWS queries, with native_layers None wherever the native product won the
        one-row (rows = 1) or the 2-8-row products, even past the rows where a library product
        is as fast (few_upto): the pass does in one call what the eager layers do in ~35 torch
        operations a layer, masked attention among them (SmolLM2, 16 rows x 4 positions at 256
        keys: 196-246 ms native, 299 eager, 193-267 with oneDNN's packed weights); with
        native_layers True wherever it runs (native_choice.py timed it the faster), False
        never. A model held in GGUF blocks runs it wherever it can (its eager layers multiply by
        the same block product, ~35 torch operations a layer more)."""
        if self.native_layers is False or rows > native.MAX_ROWS or torch.compiler.is_compiling():
            return None
        if self._native_pass is None or self._native_pass.stale(self):
            self._native_pass = NativePass(self)
        whole = self._native_pass
        if not whole.runs or (self.native_layers is None and not whole.held
                              and self.kernels.form(min(rows, 2)) != "native"):
            return None
        return whole

    def native_pass_rows(self) -> str | None:
        """The pass sizes (queries, B x T) that run as one native call, for metrics.json: "1-32
        queries", or None where none do (no compiler, packed or 16-bit weights, ...)."""
        rows = [r for r in range(1, native.MAX_ROWS + 1) if self._native_layers(r) is not None]
        if not rows:
            return None
        return f"{rows[0]} query" if rows == [1] else f"{rows[0]}-{rows[-1]} queries"

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                 cache, logits_to_keep: int = 0, capture: tuple[int, ...] = (),
                 captured: list | None = None, plan_mask: bool = False,
                 logits: bool = True) -> torch.Tensor | None:
        """Logits [B, T or logits_to_keep, V]. `capture`: layer indices whose *input* (the
        residual stream entering layer i, as transformers' hidden_states[i]) is appended to
        `captured` [B, T, E] each, for draft heads that read the target's hidden states; index
        num_layers: the final normed state (transformers' last hidden_states entry).
        `plan_mask`: the mask is the one `cache.plan` describes (causal by position, or its
        token tree's; no sliding window past its width, no bucket padding), so a pass of a few
        queries (a ragged batch's real ones) may run as one native call (backends/lean/native_pass.py).
        `logits=False`: no LM head (a prefill, which only caches): None, after any captures."""
        B, T = input_ids.shape
        x = self.embedding(input_ids)                                                 # [B, T, E]
        # a row fed nothing sits at its length, which may equal kv_len: one row more
        cos, sin = self._rope(positions, x.dtype, cache.get_seq_length() + 1)         # [B, 1, T, D]
        ragged = cache.plan.ragged if plan_mask else None
        queries = B * T if ragged is None else ragged[2].numel()      # a ragged batch's real ones
        dual = self._dual is not None and B * T >= self.dual_from
        layers, head = self._dual if dual else (self.layers, self.lm_head)
        # a prefill (only its last row's logits wanted) of bfloat16 weights on a CPU that
        # multiplies bfloat16 itself: the eager layers, with oneDNN's bfloat16 products
        prefill = bf16_weights.prefill_layers(layers) \
            if (logits_to_keep == 1 or not logits) and queries >= bf16_weights.LIBRARY_ROWS \
            else None
        if prefill is not None:
            layers = prefill
        whole = self._native_layers(queries) if plan_mask and not dual and prefill is None \
            else None
        final = len(layers) in capture
        # every position's logits wanted: the LM head in the pass's own call, where its
        # product is the native one (the same bits as _normed_mm's)
        kind = self.kernels.fused_kind(head, self.norm, queries) \
            if whole is not None and logits and not logits_to_keep and not final else None
        fused = None if kind is None else (self.norm, head, kind)
        out = None if whole is None else whole(x, cache, cos, sin, capture, captured, fused)
        if out is not None and out is not x:            # the logits [B, T, V], not the stream
            return out
        for i, weights in enumerate(() if out is not None else layers):
            if i in capture:
                captured.append(x)                                                    # [B, T, E]
            x = self.layer(i, weights, x, cos, sin, mask, cache.update)
        if not final and not logits:
            return None
        if logits_to_keep and not final:
            x = x[:, -logits_to_keep:]
        if not final:
            return self._normed_mm(x, self.norm, head)                                # [B, T, V]
        x = self._rms(x, self.norm)                                                   # [B, T, E]
        captured.append(x)                                                            # [B, T, E]
        if not logits:
            return None
        x = x[:, -logits_to_keep:] if logits_to_keep else x
        return self.mm(x, head)                                                       # [B, T, V]
