"""An EAGLE-3 draft head: one decoder layer that reads the target's own hidden states.

The head drafts from the target's features instead of running a second model from scratch
(Li et al., EAGLE-3, 2025; the format below is the one SafeAILab's EAGLE repository trains and
vLLM's `llama_eagle3.py` and SGLang's load):

    h    = fc(cat(h_a, h_b, h_c))          # three target layers' inputs, [.., 3E] -> [.., E]
    x    = cat(input_layernorm(embed(tok)), hidden_norm(h))           # [.., 2E], embeds first
    h    = h + o_proj(attention(x))        # its own KV cache, RoPE at the pair's position
    h    = h + mlp(post_attention_layernorm(h))
    q    = lm_head(norm(h))                # over a reduced draft vocabulary
    target id = draft id + d2t[draft id]

Pair t is (the target's hidden state at position t, the token at t + 1) at RoPE position t, and
predicts the token at t + 2. A later draft step feeds back the head's own pre-norm `h` in place of
fc(...) (its width is already E, so fc is skipped), with the token it just drafted.

Checkpoints: `config.json` (a Llama config with num_hidden_layers 1, `draft_vocab_size`,
`target_hidden_size`, `eagle_config.eagle_aux_hidden_state_layer_ids`) and safetensors with
`fc.weight`, `midlayer.*` (or vLLM's `layers.0.*`), `norm.weight`, `lm_head.weight`, `d2t`, `t2d`.
The token embedding is the target's (published heads leave it out).
"""
from __future__ import annotations

import json
import math
import pathlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from specflow.errors import ConfigError
from specflow.paths import DEMO_DIR, SMOLLM2_HEAD_DIR
from specflow.backends.lean.kernels import grouped_attention, pick_one_query_attention
from specflow.backends.lean.forward import rotate

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "LlamaForCausalLM")


@dataclass
class HeadShape:
    """What a head's config.json says, in the fields this module uses."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    layer_ids: list[int] = field(default_factory=list)
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def to_config(self) -> dict:
        """config.json as published EAGLE-3 heads have it (vLLM and SGLang read these names)."""
        return {
            "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": 1, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.dim,
            "hidden_act": "silu", "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size, "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size, "tie_word_embeddings": False,
            "torch_dtype": "float16",
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.layer_ids),
                             "use_aux_hidden_state": True},
        }


def default_layer_ids(num_layers: int) -> list[int]:
    """The target layers (inputs of) a head reads when neither its config nor train_head.layers
    names them: EAGLE-3's low, middle and high layers (2, L/2, L-3), which vLLM and SafeAILab use,
    kept distinct on shallow targets, where those three collide (L = 4: 1, 2, 3; L = 5 and 6:
    2, 3, 4), and every layer of a target with fewer than three (too few: layer_ids_problem)."""
    if num_layers < 3:
        return list(range(num_layers))
    low = min(2, num_layers - 3)
    high = max(num_layers - 3, low + 2)
    mid = min(max(num_layers // 2, low + 1), high - 1)
    return [low, mid, high]


def layer_ids_problem(ids: list[int], num_layers: int | None = None) -> str | None:
    """Why a head cannot read the inputs of layers `ids` (None when it can): the target's pass
    hands out each layer once and in layer order, so they must be two or more distinct layers
    (one would leave fc's input as wide as the head's own state), none negative, and, when the
    target's depth is known, below it."""
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if repeated:
        return f"repeats layer {repeated[0]} in {ids}; each layer's input is handed out once"
    if len(ids) < 2:
        return f"names {len(ids)} layer(s) {ids}; a head reads the inputs of two or more layers"
    bad = [i for i in ids if i < 0 or (num_layers is not None and i >= num_layers)]
    if bad:
        where = f"of a {num_layers}-layer target" if num_layers is not None else "(negative)"
        return f"has layers {bad} {where}"
    return None


@dataclass
class TargetDims:
    """What a head is checked against (an HFBackend has the same attributes): at compose time
    they come from the target folder's config.json, before any weights load."""

    num_layers: int
    hidden_size: int
    vocab_size: int
    path: str


def target_dims(cfg) -> TargetDims | None:
    """The target's depth, width and vocabulary from config.json when model=hf (model=demo too)
    points at a local folder; None when it does not or the file says too little (the checks
    then wait for the loaded model)."""
    from omegaconf import OmegaConf

    if cfg.get("model") is None or cfg.model.get("name") != "hf":
        return None
    path = OmegaConf.select(cfg, "model.path", throw_on_missing=False)
    if path is None:
        return None
    try:
        config = json.loads((pathlib.Path(str(path)).expanduser() / "config.json").read_text())
        dims = [next(config[k] for k in keys if k in config) for keys in (
            ("num_hidden_layers", "n_layer"), ("hidden_size", "n_embd"), ("vocab_size",))]
    except (OSError, ValueError, TypeError, StopIteration):
        return None
    if not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        return None
    return TargetDims(*dims, path=str(path))


def train_layer_ids(layers, dims) -> list[int]:
    """The layers train-head's head reads: `layers` (train_head.layers) or the default for the
    target's depth, checked (repeats, negative ids, too few: always; the range: when `dims`, an
    HFBackend or TargetDims, is known). Sorted: the target's pass hands them out in layer order."""
    if not layers and dims is None:
        return []                       # the default waits for the target's depth
    ids = [int(i) for i in layers] if layers else default_layer_ids(dims.num_layers)
    problem = layer_ids_problem(ids, dims.num_layers if dims is not None else None)
    if problem is None:
        return sorted(ids)
    if not layers:
        raise ConfigError(f"train-head: the target {dims.path!r} has {dims.num_layers} layer(s), "
                          f"too few for a draft head (it reads the inputs of two or more "
                          f"distinct layers); train one for a deeper target")
    span = f" in 0..{dims.num_layers - 1}, e.g. train_head.layers=" \
           f"{default_layer_ids(dims.num_layers)}" if dims is not None else ""
    raise ConfigError(f"train_head.layers={ids} {problem}; give two or more distinct layer "
                      f"ids{span}")


DEMO_HEAD = DEMO_DIR / "eagle"     # the demo target's head
SMOLLM2_HEAD = SMOLLM2_HEAD_DIR    # SmolLM2-135M-Instruct's


def demo_head_for(target) -> str | None:
    """The shipped head's folder when `target` (an HFBackend, or TargetDims at compose time) is
    a target specflow ships a head for: the embedded demo target, or SmolLM2-135M-Instruct (its
    GGUF, by file name: model=smollm2 or a path to the same file)."""
    from specflow.backends.hf.gguf import SMOLLM2_FILE

    try:
        same = pathlib.Path(target.path).resolve() == (DEMO_DIR / "target").resolve()
    except (OSError, TypeError):
        return None
    head = DEMO_HEAD if same else SMOLLM2_HEAD if str(target.path).endswith(SMOLLM2_FILE) \
        else None
    return str(head) if head is not None and (head / "config.json").is_file() else None


def missing_head(target_path: str) -> ConfigError:
    return ConfigError(f"proposer=eagle needs a head for {target_path!r}: set "
                       f"proposer.path=<folder with an EAGLE-3 head> (train one with "
                       f"`specflow train-head`); only the demo target and SmolLM2-135M "
                       f"(model=smollm2) have one built in")


def check_config(cfg) -> None:
    """proposer=eagle's check at compose time (Component.check), before any model loads: its
    head folder (exists, has a head's config.json and weights, fits the target), against the
    target folder's config.json when it is local (target_dims); load_head checks again."""
    proposer = cfg.get("proposer")
    if proposer is not None and proposer.get("name") == "eagle":
        dims = target_dims(cfg)
        path = proposer.get("path") or (demo_head_for(dims) if dims is not None else None)
        if path is None and dims is not None:
            raise missing_head(dims.path)
        if path is not None:
            check_head_folder(str(path), dims)


def check_train_layers(cfg) -> None:
    """A transformers target's check at compose time: train-head's layers against its
    config.json (a config without train_head has nothing to check)."""
    if cfg.get("train_head") is not None:
        train_layer_ids(cfg.train_head.get("layers"), target_dims(cfg))


class _Attention(nn.Module):
    def __init__(self, s: HeadShape):
        super().__init__()
        E, D = s.hidden_size, s.dim
        self.q_proj = nn.Linear(2 * E, s.num_attention_heads * D, bias=False)
        self.k_proj = nn.Linear(2 * E, s.num_key_value_heads * D, bias=False)
        self.v_proj = nn.Linear(2 * E, s.num_key_value_heads * D, bias=False)
        self.o_proj = nn.Linear(s.num_attention_heads * D, E, bias=False)


class _MLP(nn.Module):
    def __init__(self, s: HeadShape):
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)


class _RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:      # four plain ops: F.rms_norm costs ~40 us a call on a
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
        x32 = x.float()                   # CPU for a one-row step, ~4x these

        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class _Midlayer(nn.Module):
    def __init__(self, s: HeadShape):
        super().__init__()
        self.input_layernorm = _RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.hidden_norm = _RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.post_attention_layernorm = _RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.self_attn = _Attention(s)
        self.mlp = _MLP(s)


class Eagle3Head(nn.Module):
    """The head's weights and its computation; `embed` is the target's token embedding (shared,
    not a parameter of the head)."""

    def __init__(self, shape: HeadShape, embed: torch.Tensor):
        super().__init__()
        self.shape = shape
        self.fc = nn.Linear(len(shape.layer_ids) * shape.target_hidden_size, shape.hidden_size,
                            bias=False)
        self.midlayer = _Midlayer(shape)
        self.norm = _RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.lm_head = nn.Linear(shape.hidden_size, shape.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(shape.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(shape.vocab_size, dtype=torch.bool))
        self.embed = embed.detach()                     # [V, E], the target's, never trained
        self._cos = self._sin = None
        self._mm = None                                 # set by prepare(): inference products

    def prepare(self) -> None:
        """For drafting: q/k/v and gate/up fused *in place* (the modules' weights become views,
        nothing is held twice) and products in the form measured fastest for a few rows on this
        machine (`kernels.pick`, as the lean forward does). Training leaves the head unprepared
        (nn.Linear, autograd)."""
        from specflow.backends.lean.kernels import pick
        from specflow.backends.lean.forward import fuse_in_place

        m = self.midlayer
        with torch.no_grad():
            self._wqkv = fuse_in_place([m.self_attn.q_proj, m.self_attn.k_proj, m.self_attn.v_proj])
            self._wgu = fuse_in_place([m.mlp.gate_proj, m.mlp.up_proj])
        self._mm = pick([self.fc.weight, self._wqkv, m.self_attn.o_proj.weight, self._wgu,
                         m.mlp.down_proj.weight, self.lm_head.weight]).matmul

    # --- vocabulary ------------------------------------------------------------------------

    def set_vocab(self, used: torch.Tensor) -> None:
        """The draft vocabulary: `used` [Vd] target ids, sorted (EAGLE-3 keeps them by id)."""
        used = used.sort().values
        self.d2t.copy_(used - torch.arange(len(used)))
        self.t2d.zero_()
        self.t2d[used] = True

    @property
    def draft_ids(self) -> torch.Tensor:
        """Target id of each draft-vocabulary entry [Vd]."""
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    # --- computation -----------------------------------------------------------------------

    def rope(self, positions: torch.Tensor, dtype, needed: int | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, 1, T, D] at positions [B, T], from a table grown on demand to `needed`
        rows (drafting passes it from the host: reading positions.max() would sync a device)."""
        need = needed if needed is not None else \
            (int(positions.max()) + 1 if positions.numel() else 1)
        cos, sin = self.rope_table(dtype, need, positions.device)                     # [P, D]
        return cos[positions][:, None], sin[positions][:, None]

    def rope_table(self, dtype, needed: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary tables cos, sin [P, D] (contiguous), grown to at least `needed` rows."""
        if self._cos is None or self._cos.shape[0] < needed or self._cos.dtype != dtype:
            D = self.shape.dim
            inv = 1.0 / (self.shape.rope_theta ** (torch.arange(0, D, 2).float() / D))  # [D/2]
            rows = max(256, 1 << (needed - 1).bit_length())
            freqs = torch.arange(rows).float()[:, None] * inv[None]                     # [P, D/2]
            emb = torch.cat([freqs, freqs], -1).to(device)                               # [P, D]
            self._cos, self._sin = emb.cos().to(dtype), emb.sin().to(dtype)
        return self._cos, self._sin

    def layer_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """fc over concatenated target states [.., nE_t] -> [.., E]; a head state passes as is."""
        if hidden.shape[-1] == self.shape.hidden_size:
            return hidden
        return self._mm(hidden, self.fc.weight) if self._mm else self.fc(hidden)

    def qkv(self, h: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
            needed: int | None = None):
        """The attention inputs of pairs (h [B, T, E], tokens [B, T]) at positions [B, T]
        (all below `needed` when given): q [B, H, T, D], k and v [B, Hkv, T, D]."""
        s, m = self.shape, self.midlayer
        B, T, _ = h.shape
        x = torch.cat([m.input_layernorm(F.embedding(tokens, self.embed).to(h.dtype)),
                       m.hidden_norm(h)], -1)                                     # [B, T, 2E]
        cos, sin = self.rope(positions, h.dtype, needed)
        H, Hkv, D = s.num_attention_heads, s.num_key_value_heads, s.dim
        if self._mm is not None:
            q, k, v = self._mm(x, self._wqkv).split([H * D, Hkv * D, Hkv * D], -1)
        else:
            q, k, v = m.self_attn.q_proj(x), m.self_attn.k_proj(x), m.self_attn.v_proj(x)
        q = q.reshape(B, T, H, D).transpose(1, 2)                                  # [B, H, T, D]
        k = k.reshape(B, T, Hkv, D).transpose(1, 2)
        v = v.reshape(B, T, Hkv, D).transpose(1, 2)
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def finish(self, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual, MLP: the layer's pre-norm output [B, T, E] from attn [B, H, T, D]."""
        m = self.midlayer
        B, _, T, _ = attn.shape
        a = attn.transpose(1, 2).reshape(B, T, -1)                                   # [B, T, HD]
        mm = self._mm
        if mm is None:
            h = h + m.self_attn.o_proj(a)
            y = m.post_attention_layernorm(h)
            return h + m.mlp.down_proj(F.silu(m.mlp.gate_proj(y)) * m.mlp.up_proj(y))
        h = h + mm(a, m.self_attn.o_proj.weight)
        gate, up = mm(m.post_attention_layernorm(h), self._wgu).chunk(2, -1)          # [B, T, I] x2
        return h + mm(F.silu(gate) * up, m.mlp.down_proj.weight)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [.., Vd] of pre-norm states [.., E]."""
        if self._mm is None:
            return self.lm_head(self.norm(h))
        return self._mm(self.norm(h), self.lm_head.weight)

    def attend(self, q, k, v, mask):
        """q [B, H, T, D] over the cached k, v [B, Hkv, L, D], mask [B, 1, T, L] bool or None."""
        s = self.shape
        if q.shape[2] == 1:           # one query per row: grouped products where measured faster
            start = pick_one_query_attention(s.num_attention_heads, s.num_key_value_heads, s.dim,
                                             q.dtype, q.device)
            if start is not None and q.shape[0] * k.shape[2] >= start:
                return grouped_attention(q, k, v, mask)                               # [B, H, 1, D]
        gqa = s.num_attention_heads // s.num_key_value_heads
        if gqa > 1:
            k, v = k.repeat_interleave(gqa, 1), v.repeat_interleave(gqa, 1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def check_finite(self) -> None:
        """Refuse weights that are not finite (a torn or garbage checkpoint)."""
        for name, p in self.state_dict().items():
            if p.is_floating_point() and not torch.isfinite(p).all():
                raise ConfigError(f"draft head weight {name} holds NaN or inf; train or copy the "
                                  f"head again")


# --- files -----------------------------------------------------------------------------------

def _read_config(folder: pathlib.Path, what: str) -> dict:
    from specflow.io import read_json

    config = folder / "config.json"
    if not config.is_file():
        raise ConfigError(f"{what} has no config.json, so it is not a draft head; point "
                          f"proposer.path at a folder with an EAGLE-3 head (config.json and "
                          f"model.safetensors), e.g. one `specflow train-head` wrote")
    parsed = read_json(config, f"{what}: config.json", "copy the head again", ConfigError)
    if not isinstance(parsed, dict):
        raise ConfigError(f"{what}: config.json is not a JSON object; copy the head again")
    from specflow.backends.heads.speculators_format import flatten, is_speculators

    return flatten(parsed) if is_speculators(parsed) else parsed   # vLLM's speculators format


def head_shape(config: dict, target, what: str) -> HeadShape:
    """The head's shape from its config.json, checked against the target it will read (an
    HFBackend, or TargetDims at compose time; None: only what needs no target)."""
    arch = (config.get("architectures") or [""])[0]
    if config.get("num_hidden_layers", 1) != 1 or "draft_vocab_size" not in config and \
            "Eagle" not in arch:
        raise ConfigError(f"{what} is not an EAGLE-3 head (architectures={arch!r}, "
                          f"num_hidden_layers={config.get('num_hidden_layers')}); a head has one "
                          f"layer and draft_vocab_size in config.json: for a whole draft model use "
                          f"proposer=draft draft.path=<folder>")
    try:
        E = int(config["hidden_size"])
        eagle = config.get("eagle_config") or {}
        ids = eagle.get("eagle_aux_hidden_state_layer_ids",
                        config.get("eagle_aux_hidden_state_layer_ids"))
        named = [int(i) for i in ids] if ids else None
        shape = HeadShape(
            hidden_size=E, intermediate_size=int(config["intermediate_size"]),
            num_attention_heads=int(config["num_attention_heads"]),
            num_key_value_heads=int(config.get("num_key_value_heads")
                                    or config["num_attention_heads"]),
            vocab_size=int(config["vocab_size"]),
            draft_vocab_size=int(config.get("draft_vocab_size") or config["vocab_size"]),
            target_hidden_size=int(config.get("target_hidden_size") or E),
            layer_ids=named if named is not None else
            default_layer_ids(target.num_layers) if target is not None else [],
            head_dim=config.get("head_dim"), rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(config.get("rope_theta", 10000.0)),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)))
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{what}: config.json lacks or garbles {exc}; copy the head again") \
            from None
    problem = layer_ids_problem(named) if named is not None else None
    if problem:
        raise ConfigError(f"{what}: config.json's eagle_aux_hidden_state_layer_ids {problem}, so "
                          f"the head cannot run; train it again with distinct layers (specflow "
                          f"train-head train_head.layers=[...])")
    if target is not None:
        _check_against(shape, target, what)
    return shape


def _check_against(shape: HeadShape, target, what: str) -> None:
    problems = []
    if shape.target_hidden_size != target.hidden_size:
        problems.append(f"it reads hidden states of width {shape.target_hidden_size}, the target's "
                        f"are {target.hidden_size}")
    if shape.vocab_size != target.vocab_size:
        problems.append(f"vocabulary {shape.vocab_size} vs the target's {target.vocab_size}")
    bad = [i for i in shape.layer_ids if not 0 <= i < target.num_layers]
    if bad:
        problems.append(f"layers {bad} of a {target.num_layers}-layer target")
    elif layer_ids_problem(shape.layer_ids):      # the target's default ids for a shallow one
        problems.append(f"a {target.num_layers}-layer target has too few layers for a head")
    if shape.hidden_size != target.hidden_size:
        problems.append(f"its width {shape.hidden_size} differs from the target's embedding "
                        f"{target.hidden_size}")
    if problems:
        raise ConfigError(f"{what} was trained for another target ({'; '.join(problems)}); use a "
                          f"head trained on this target (specflow train-head)")


def check_head_folder(path: str, target, what: str | None = None
                      ) -> tuple[HeadShape, list[pathlib.Path]]:
    """What can be checked without reading weights: `path` is a folder with a head's config.json
    that fits `target` (see head_shape) and safetensors files. -> (shape, the weight files)."""
    folder = pathlib.Path(path).expanduser()
    what = what or f"proposer.path={path!r}"
    if not folder.is_dir():
        raise ConfigError(f"{what} is not a folder; point it at a folder with an EAGLE-3 head "
                          f"(config.json and model.safetensors)")
    shape = head_shape(_read_config(folder, what), target, what)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{what} has no .safetensors weights; copy the head's model.safetensors "
                          f"into the folder")
    return shape, files


def _strip(name: str) -> str:
    for prefix in ("model.",):
        if name.startswith(prefix) and not name.startswith("model.lm_head"):
            name = name[len(prefix):]
    return name.replace("layers.0.", "midlayer.", 1)


def read_head(path: str, target, what: str | None = None) -> tuple[Eagle3Head, torch.dtype]:
    """A published (or train-head) EAGLE-3 head folder checked against `target` (an HFBackend)
    and read into a head on the host, as saved. -> (head, the dtype it was saved in)."""
    from safetensors import safe_open

    what = what or f"proposer.path={path!r}"
    shape, files = check_head_folder(path, target, what)
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as fh:
                for key in fh.keys():
                    weights[_strip(key)] = fh.get_tensor(key)
        except Exception as exc:
            raise ConfigError(f"{what}: {file.name} is damaged ({type(exc).__name__}); copy the "
                              f"head again") from exc
    embed = target.input_embeddings()                                              # [V, E]
    head = Eagle3Head(shape, embed)
    weights.pop("embed_tokens.weight", None)           # the target's embedding is used
    if shape.draft_vocab_size == shape.vocab_size:
        weights.setdefault("d2t", torch.zeros(shape.draft_vocab_size, dtype=torch.long))
        weights.setdefault("t2d", torch.ones(shape.vocab_size, dtype=torch.bool))
    weights.setdefault("t2d", _t2d(weights.get("d2t"), shape.vocab_size))
    expected = head.state_dict()
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise ConfigError(f"{what} lacks weights {missing[:4]}{' ...' if len(missing) > 4 else ''};"
                          f" it is not a complete EAGLE-3 head: copy it again")
    for name, tensor in expected.items():
        if tuple(weights[name].shape) != tuple(tensor.shape):
            raise ConfigError(f"{what}: {name} has shape {tuple(weights[name].shape)} but its "
                              f"config.json says {tuple(tensor.shape)}; the folder mixes two heads")
    _in_layer_order(shape, weights)
    head.load_state_dict({k: weights[k] for k in expected}, strict=True)
    ids = head.draft_ids
    if int(ids.min()) < 0 or int(ids.max()) >= shape.vocab_size:
        raise ConfigError(f"{what}: d2t maps draft ids outside the target's vocabulary; copy the "
                          f"head again")
    return head, saved_dtype(weights)


def load_head(path: str, target, device: torch.device, dtype: torch.dtype | None) -> Eagle3Head:
    """A head folder (read_head) ready to draft: its weights in `dtype` (None: as saved, e.g.
    float16 for a head `specflow train-head` wrote: a drafting step then reads half the bytes of
    a float32 one, and the target's states and embedding rows are cast to it on the way in)."""
    head, saved = read_head(path, target)
    head.to(device=device, dtype=dtype or saved)
    head.d2t, head.t2d = head.d2t.long(), head.t2d.bool()
    head.check_finite()
    head.eval().requires_grad_(False)
    head.prepare()
    return head


def saved_dtype(weights: dict[str, torch.Tensor]) -> torch.dtype:
    """The floating dtype a head was saved in (its fc weight's; every product weight shares it);
    float32 for one CPU kernels do not cover (float64, float8)."""
    saved = weights["fc.weight"].dtype
    return saved if saved in (torch.float32, torch.float16, torch.bfloat16) else torch.float32


def _in_layer_order(shape: HeadShape, weights: dict[str, torch.Tensor]) -> None:
    """The lean forward hands out the layers' inputs in layer order: a head whose config names
    its layers in another order gets them sorted, and fc's column blocks (one [E, E_t] block per
    layer) with them, which computes the same."""
    ids = shape.layer_ids
    order = sorted(range(len(ids)), key=ids.__getitem__)
    if order == list(range(len(ids))):
        return
    w = weights["fc.weight"]                                                     # [E, n E_t]
    weights["fc.weight"] = w.view(w.shape[0], len(ids), -1)[:, order].reshape(w.shape)
    shape.layer_ids = [ids[i] for i in order]


def _t2d(d2t: torch.Tensor | None, vocab: int) -> torch.Tensor:
    t2d = torch.zeros(vocab, dtype=torch.bool)
    if d2t is not None:
        ids = torch.arange(len(d2t)) + d2t.long()
        t2d[ids.clamp(0, vocab - 1)] = True
    return t2d


def save_head(head: Eagle3Head, folder: str | pathlib.Path, extra: dict | None = None) -> None:
    """config.json + model.safetensors (fp16 weights, int64 d2t, bool t2d), the published layout."""
    from safetensors.torch import save

    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v.half() if v.is_floating_point() else v).contiguous().cpu()
               for k, v in head.state_dict().items()}
    tmp = folder / "model.safetensors.tmp"
    # written by Python's open(), which honours the umask (safetensors' save_file makes 0600)
    tmp.write_bytes(save(tensors, metadata={"format": "pt"}))
    tmp.replace(folder / "model.safetensors")
    config = head.shape.to_config()
    if extra:
        config["specflow"] = extra
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def init_head(shape: HeadShape, embed: torch.Tensor, seed: int = 0) -> Eagle3Head:
    """A freshly initialised head (Llama's init: normal(0, 0.02), norms 1)."""
    torch.manual_seed(seed)
    head = Eagle3Head(shape, embed)
    for module in head.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02 / math.sqrt(1.0))
    return head
