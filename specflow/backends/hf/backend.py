"""The transformers backend: any attention-based AutoModelForCausalLM, batched over ragged rows.

Each forward feeds every row its own new tokens at its own positions (explicit position ids and a
4-D mask), into a SlotKVCache that rolls back per row by length. Models whose cache cannot roll
back token by token (recurrent and hybrid state-space models) are refused with a clear message.
"""
from __future__ import annotations

import contextlib
import inspect
import os
import pathlib
import sys
from dataclasses import dataclass
from typing import Any

import torch

from specflow.config import check_backend_settings
from specflow.errors import ConfigError
from specflow.backends.contract import Backend, DecoderShape, GrammarVocabulary, Tokenizer
from specflow.backends.hf import file_model, file_products
from specflow.backends.hf.file_products import is_placeholder
from specflow.backends.lean.quantized import activation_dtype, bf16_weight_only
from specflow.backends.plan import ForwardPlan, make_plan
from specflow.backends.slot_cache import SlotKVCache
from specflow.paths import DEMO_DIR  # noqa: F401 - where callers have always found it
from specflow.state import PAD, HiddenStates

# model types whose per-sequence state is recurrent: a rejected draft cannot be un-read
RECURRENT_MODEL_TYPES = {
    "mamba", "mamba2", "falcon_mamba", "rwkv", "recurrent_gemma", "jamba", "zamba", "zamba2",
    "bamba", "granitemoehybrid", "falcon_h1", "nemotron_h", "lfm2", "qwen3_next", "xlstm",
    "minimax", "plamo2", "kimi_linear",
}
# padded tokens in one prefill forward: bounds its activations (a long prompt goes alone)
PREFILL_TOKENS = 4096
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
WEIGHT_BITS = {"int8": 8, "int4": 4}    # weight-only, CPU (backends/lean/quantized.py)


@dataclass
class HFModelConfig:
    name: str = "hf"
    path: str = "???"                 # a directory from_pretrained loads, or a hub id in the local cache
    dtype: str = "float32"            # float32 | float16 | bfloat16 | int8 | int4 | auto (the
                                      # checkpoint's); int8/int4: weight-only, CPU
    group_size: int = 32              # int4: weights sharing one scale and zero
    activations: str = "auto"         # int8/int4/bfloat16: what the products read and write:
                                      # auto (float32 on specflow's native kernel, bfloat16 on
                                      # ATen's int8/int4, 4-10x slower in float32), float32,
                                      # bfloat16 (with dtype=bfloat16: a whole bfloat16 model)
    device_map: str | None = None     # "auto": spread a large target over the GPUs (accelerate)
    attn_implementation: str = "sdpa"
    trust_remote_code: bool = False
    forward: str = "auto"             # hf | lean | auto (lean where the architecture allows)
    max_model_len: int | None = None  # the context served (default: the model's); the KV cache
                                      # holds max_batch_size x this many positions
    graphs: bool = False              # chain passes as static-shape steps per bucket, captured as
                                      # CUDA graphs on a GPU (backends/lean/graph_step.py)
    huge_pages: bool = True           # the lean forward's CPU weights in 2 MB transparent huge
                                      # pages where Linux offers them (backends/lean/huge_pages.py)
    # what tune() chooses (the root keys of the same names fill them: `threads=2` or
    # `model.threads=2`); auto: timed at start
    threads: Any = "auto"             # a target's CPU threads: auto (all cores or one) or a count
    pack: Any = "auto"                # the lean forward's weights in oneDNN's packed layout
    native: Any = "auto"              # passes through the decoder layers as one native call

    def __post_init__(self) -> None:
        if self.max_model_len is not None and (isinstance(self.max_model_len, bool)
                                               or int(self.max_model_len) < 2):
            raise ConfigError(f"max_model_len={self.max_model_len!r}; give the context to serve "
                              f"in tokens (at least 2), or null for the model's own")
        if self.forward not in ("hf", "lean", "auto"):
            raise ConfigError(f"forward={self.forward!r}; use hf, lean or auto")
        if self.dtype not in (*DTYPES, *WEIGHT_BITS, "auto"):
            raise ConfigError(f"model.dtype={self.dtype!r}; use float32, float16, bfloat16, int8, "
                              f"int4 or auto")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) \
                or self.group_size not in (32, 64, 128, 256):
            raise ConfigError(f"model.group_size={self.group_size!r}; use 32, 64, 128 or 256 "
                              f"(weights per int4 scale)")
        if self.activations not in ("auto", "bfloat16", "float32"):
            raise ConfigError(f"model.activations={self.activations!r}; use auto, bfloat16 or "
                              f"float32 (with dtype=int8, int4 or bfloat16)")
        check_backend_settings(threads=self.threads, pack=self.pack, native=self.native)
        if self.attn_implementation not in ("sdpa", "eager"):
            raise ConfigError(f"model.attn_implementation={self.attn_implementation!r}; use sdpa "
                              f"or eager")


class HFTokenizer(Tokenizer):
    """The few calls the pipeline makes, over a transformers tokenizer."""

    def __init__(self, tok, eos_ids: frozenset[int]):
        self.tok = tok
        self.eos_token_id = tok.eos_token_id
        self.eos_token_ids = eos_ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok(text, add_special_tokens=add_special_tokens)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def __len__(self) -> int:
        return len(self.tok)

    def grammar_vocabulary(self, eos_id: int) -> GrammarVocabulary:
        """Each token's bytes, read off its vocabulary string the way outlines-core reads a
        transformers tokenizer's (byte-level BPE, SentencePiece with byte fallback, or plain:
        specflow.constraints.index)."""
        from specflow.constraints.index import token_bytes, vocab_key

        return GrammarVocabulary(vocab_key(self.tok, eos_id),
                                 lambda: token_bytes(self.tok, eos_id))


def resolve_path(path: str, role: str = "model") -> str:
    """A local directory stays as is; a .gguf file (or `pkg:<module>/<file>`, a file inside an
    installed package) becomes its converted folder; anything else must be a hub id already in
    the local cache (resolved offline to its snapshot folder: nothing is downloaded at run time)."""
    if path.startswith("pkg:"):           # a model file inside an installed package
        from specflow.backends.hf.gguf import package_file

        path = package_file(path, role)
    if path.lower().endswith(".gguf"):     # converted once into an HF folder (backends/hf/gguf.py)
        from specflow.backends.hf.gguf import gguf_folder

        return gguf_folder(path, role)
    if os.path.isdir(os.path.expanduser(path)):
        return os.path.expanduser(path)
    if path.startswith(("/", ".", "~")) or path.count("/") > 1 or path in ("", "???"):
        raise ConfigError(f"model path {path!r} is not a directory; set model.path (or draft.path) "
                          f"to a folder that AutoModelForCausalLM.from_pretrained can load")
    return cached_snapshot(path, role)


def cached_snapshot(repo_id: str, role: str = "model") -> str:
    """The local snapshot folder of a hub id, looked up in the HF cache without any network."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        return snapshot_download(repo_id, local_files_only=True)
    except HFValidationError:
        raise ConfigError(f"model path {repo_id!r} is not a directory; set model.path (or "
                          f"draft.path) to a folder that AutoModelForCausalLM.from_pretrained "
                          f"can load") from None
    except OSError:       # LocalEntryNotFoundError: not in the cache (no network is tried)
        raise ConfigError(f"{role}.path={repo_id!r} is not a local folder and not in the local "
                          f"Hugging Face cache ({constants.HF_HUB_CACHE}); nothing is downloaded "
                          f"at run time: fetch it first (hf download {repo_id}) or set "
                          f"{role}.path to a local folder") from None


def _brief(exc: BaseException) -> str:
    """`Type: first line` of an exception, cut to a readable length."""
    lines = str(exc).strip().splitlines()
    text = lines[0].strip().rstrip(".:;,") if lines else ""
    if len(text) > 200:
        stop = text.find(". ", 40, 200)
        text = text[:stop] if stop > 0 else text[:200] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def check_model_dir(path: str, name: str, role: str = "model") -> None:
    """Refuse a folder from_pretrained cannot load, naming the file: no config.json, a config
    that is not JSON or has no model_type, a damaged safetensors file (header check only)."""

    folder = pathlib.Path(path)
    what = f"{role}.path={name!r}"
    try:
        names = {p.name for p in folder.iterdir()}
    except OSError as exc:
        raise ConfigError(f"{what} cannot be read ({exc.strerror}); check the folder's "
                          f"permissions") from None
    if not names:
        raise ConfigError(f"{what} is an empty folder; point {role}.path at a folder that "
                          f"save_pretrained wrote (config.json, weights, tokenizer)")
    config = folder / "config.json"
    ggufs = sorted(n for n in names if n.lower().endswith(".gguf"))
    if not config.is_file() and ggufs:
        example = folder / ggufs[0]
        raise ConfigError(f"{what} has no config.json but holds GGUF "
                          f"file{'s' if len(ggufs) > 1 else ''} ({', '.join(ggufs)}); point "
                          f"{role}.path at the one to load, e.g. {role}.path={example}")
    if not config.is_file():
        raise ConfigError(f"{what} has no config.json, so it is not a saved model; point "
                          f"{role}.path at a folder that save_pretrained wrote (config.json, "
                          f"weights, tokenizer)")
    from specflow.io import json_type, read_json

    parsed = read_json(config, f"{what}: config.json", "restore config.json from the model's "
                       "source", ConfigError)
    if not isinstance(parsed, dict):
        raise ConfigError(f"{what}: config.json holds a JSON {json_type(parsed)}, not an object; "
                          f"restore config.json from the model's source")
    if not parsed.get("model_type") or not isinstance(parsed["model_type"], str):
        raise ConfigError(f"{what}: config.json has no model_type string, so transformers "
                          f"cannot tell the architecture; restore config.json from the model's "
                          f"source")
    model_type = parsed["model_type"]
    if "auto_map" not in parsed:              # remote code brings its own architecture
        from transformers import __version__
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        if model_type not in CONFIG_MAPPING:
            raise ConfigError(f"{what}: config.json has model_type={model_type!r}, which "
                              f"transformers {__version__} does not know; upgrade transformers "
                              f"or fix model_type in config.json")
    if not names & TOKENIZER_FILES and not any(n.endswith((".model", ".tiktoken")) for n in names):
        raise ConfigError(f"{what} has no tokenizer files (tokenizer.json, tokenizer_config.json, "
                          f"...); save the model's tokenizer into the folder too "
                          f"(tokenizer.save_pretrained)")
    from safetensors import safe_open

    for weights in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(weights), framework="pt") as fh:
                fh.keys()
        except Exception as exc:     # SafetensorError (and OSError): a torn or garbage file
            raise ConfigError(f"{what}: {weights.name} is damaged ({_brief(exc)}); copy or "
                              f"download the model again") from exc


TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt",
                   "merges.txt", "tekken.json"}
# what from_pretrained raises on files it cannot use (an out-of-memory error is not one of them)
LOAD_ERRORS = (OSError, ValueError, ImportError, RuntimeError, KeyError, EOFError)


@contextlib.contextmanager
def held_warnings():
    """transformers' log records while loading, held back: shown once loading succeeds, dropped
    when it fails (the one-line error says what went wrong; SPECFLOW_TRACEBACK=1 shows them)."""
    import logging

    lib = logging.getLogger("transformers")
    held: list[logging.LogRecord] = []

    class Hold(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            held.append(record)

    saved = lib.handlers[:], lib.propagate
    lib.handlers, lib.propagate = [Hold()], False
    loaded = False
    try:
        yield
        loaded = True
    finally:
        lib.handlers, lib.propagate = saved
        if loaded or os.environ.get("SPECFLOW_TRACEBACK") == "1":
            for record in held:
                lib.handle(record)


def check_group_size(config, group: int, role: str, name: str) -> None:
    """int4 scales whole groups of a row's inputs: the group size must divide the width each
    product reads (the hidden size, the attention output, the intermediate size), or those
    weights could not be held; refused before the weights load, naming a size that fits."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    widths = {"hidden": config.hidden_size, "attention output": heads * head_dim,
              "intermediate": getattr(config, "intermediate_size", config.hidden_size)}
    bad = next(((what, k) for what, k in widths.items() if k % group), None)
    if bad is None:
        return
    fits = [g for g in (32, 64, 128, 256) if all(k % g == 0 for k in widths.values())]
    fix = f"use {role}.group_size={fits[-1]}" if fits else f"use {role}.dtype=int8"
    raise ConfigError(f"{role}.group_size={group} does not divide the {bad[0]} width {bad[1]} of "
                      f"{name!r} (int4 scales whole groups of a row); {fix}")


def load_model(cfg: HFModelConfig, device: torch.device, role: str = "model",
               products_from_file: bool = True):
    """(model, tokenizer, name). `products_from_file`: where every layer product will be held
    in a GGUF file's blocks (dtype=auto), build the model without their float32 weights
    (backends/hf/file_products.py)."""
    import pickle

    from safetensors import SafetensorError
    from transformers.utils import logging as hf_logging

    from specflow.backends.hf.tokenizers import open_tokenizer, take_tokenizer

    hf_logging.disable_progress_bar()   # specflow shows its own progress (GGUF conversion too)

    path = resolve_path(cfg.path, role)
    name = path if os.path.isdir(os.path.expanduser(cfg.path)) else cfg.path   # hub id as given
    check_model_dir(path, name, role)
    if products_from_file:     # without transformers' model classes where it can (file_model.py)
        light = file_model.load_light(cfg, path, device)
        if light is not None:
            return (*light, name)
    from transformers import AutoConfig, AutoModelForCausalLM
    # local_files_only: never reach for the network (remote code, tokenizer checks, shards)
    kwargs = dict(trust_remote_code=cfg.trust_remote_code, local_files_only=True)
    try:
        config = AutoConfig.from_pretrained(path, **kwargs)
    except LOAD_ERRORS as exc:
        raise ConfigError(f"cannot load the config of {role} {name!r}: {_brief(exc)}; restore "
                          f"config.json from the model's source") from exc
    try:
        tokenizer = take_tokenizer(path)      # loaded by a check before the weights, or now
        if tokenizer is None:
            tokenizer = open_tokenizer(path, cfg.trust_remote_code)
    except Exception as exc:          # the tokenizers library raises plain Exception on bad files
        raise ConfigError(f"cannot load the tokenizer of {role} {name!r}: {_brief(exc)}; the "
                          f"folder needs the model's tokenizer files (tokenizer.json, "
                          f"tokenizer_config.json) as save_pretrained writes them") from exc
    refuse_recurrent(config, name)
    if cfg.dtype == "int4":
        check_group_size(config, cfg.group_size, role, name)
    dtype = "auto" if cfg.dtype == "auto" else torch.float32 if cfg.dtype in WEIGHT_BITS \
        or bf16_weight_only(cfg.dtype, cfg.activations, device, cfg.device_map) \
        else DTYPES[cfg.dtype]
    load = dict(kwargs, attn_implementation=cfg.attn_implementation, dtype=dtype)
    if cfg.device_map:
        load["device_map"] = cfg.device_map
    try:
        with held_warnings():
            if products_from_file and file_products.wanted(cfg, path, config, device):
                return file_products.load(path, config, cfg.attn_implementation), tokenizer, name
            model = AutoModelForCausalLM.from_pretrained(path, config=config, **load)
    except torch.OutOfMemoryError:
        raise
    except (*LOAD_ERRORS, SafetensorError, pickle.UnpicklingError) as exc:
        if "ignore_mismatched_sizes" in str(exc) or "size mismatch" in str(exc):
            raise ConfigError(f"cannot load {role} {name!r}: the shapes of its weights do not "
                              f"match its config.json (hidden size, layers or vocabulary); the "
                              f"folder mixes files of two models: restore config.json or the "
                              f"weights") from exc
        raise ConfigError(f"cannot load {role} {name!r}: {_brief(exc)}; check that the folder "
                          f"holds the complete weights save_pretrained wrote") from exc
    if not cfg.device_map:
        model.to(device)
    model.eval()
    return model, tokenizer, name


def refuse_recurrent(config, path: str) -> None:
    layer_types = set(getattr(config, "layer_types", None) or [])
    recurrent = (config.model_type in RECURRENT_MODEL_TYPES
                 or layer_types & {"mamba", "linear_attention", "conv", "recurrent", "mamba2"})
    if recurrent:
        raise ConfigError(f"{path!r} (model_type={config.model_type}) keeps a recurrent state that "
                          f"cannot be rolled back token by token, so rejected drafts cannot be "
                          f"undone; specflow needs an attention model with a KV cache")


class HFBackend(Backend):
    name = "hf"
    # what tune() chose: torch's CPU threads (the target only), whether the lean forward's
    # weights are packed for oneDNN (any pass of a draft model: see packing.plan_draft)
    threads: int | None = None
    packed: bool = False

    def __init__(self, cfg: HFModelConfig, device: torch.device, slots: int, role: str = "model"):
        self.role = role               # "model" (the target) or "draft": what tune() chooses
        self.settings = {"threads": cfg.threads, "pack": cfg.pack, "native": cfg.native}
        self.chosen: dict = {}         # tune()'s decisions, as each Choice describes them
        self.model, tok, self.path = load_model(cfg, device, role)
        # the layer products left as placeholders, to be the GGUF file's blocks
        # (file_products.py): _file_blocks then reads its checks' values from the folder
        self.products_from_file = is_placeholder(self.model.model.layers[0].mlp.down_proj.weight) \
            if hasattr(getattr(self.model, "model", None), "layers") else False
        config = self.model.config
        self.device = self.model.device
        eos = getattr(self.model.generation_config, "eos_token_id", None) or tok.eos_token_id
        eos_ids = frozenset(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
        self.tokenizer = HFTokenizer(tok, eos_ids)
        self.eos_token_id = tok.eos_token_id if tok.eos_token_id is not None else next(iter(eos_ids), None)
        self.eos_token_ids = eos_ids
        self.vocab_size = config.vocab_size
        self.max_length = getattr(config, "max_position_embeddings", None)
        if cfg.max_model_len is not None:      # a shorter context: a smaller cache (never longer)
            self.max_length = min(self.max_length or cfg.max_model_len, int(cfg.max_model_len))
        num_layers = config.num_hidden_layers
        # a little headroom past the context for the k+1 positions a last round may write
        # (graphs: one column more, the scratch column padding positions write to)
        self.cache = SlotKVCache(num_layers, slots,
                                 (self.max_length or 1 << 16) + 64 + bool(cfg.graphs))
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._keeps_logits = "logits_to_keep" in params
        self._bool_mask = cfg.attn_implementation == "sdpa"
        # Mistral attends to the last `sliding_window` keys only; the explicit mask says so
        self.window = getattr(config, "sliding_window", None) if config.model_type == "mistral" else None
        from specflow.backends import choice_cache

        self.weights = None    # int8/int4 or a file's blocks: what the products read (describe())
        bits = WEIGHT_BITS.get(cfg.dtype)
        if bits is not None and self.device.type != "cpu":
            raise ConfigError(f"{role}.dtype={cfg.dtype} runs on a CPU (ATen's weight-only "
                              f"products); on {self.device.type} use bfloat16 or float16")
        # LeanLlama.quantize's arguments: (bits, group size, activations[, blocks, head bits])
        activations = activation_dtype(cfg.activations)
        quantize = None if bits is None else (bits, cfg.group_size, activations)
        half = torch.bfloat16 if bf16_weight_only(cfg.dtype, cfg.activations, self.device,
                                                  cfg.device_map) else None
        blocks = self._file_blocks(cfg) if cfg.dtype == "auto" else None
        if blocks is not None:               # the blocks' loading left freed temporaries
            file_products.release_freed()
        if blocks is None and self.products_from_file:     # not held after all: read them
            self.model = load_model(cfg, device, role, products_from_file=False)[0]
            self.products_from_file = False
        if blocks is not None:                # a GGUF file's blocks, as they are
            bits = max(w.bits for (layer, _), w in blocks[0].items() if layer >= 0)
            # a tied embedding looked up in the file's head blocks (LeanLlama.quantize)
            quantize = (bits, 32, activations, *blocks, True)
        # a bf16 / f16 file's weights in their 16 bits under dtype=auto
        half_file = self._file_half(cfg) if blocks is None and cfg.dtype == "auto" else None
        half = half or half_file
        if half is not None:     # bf16_weights.py: bfloat16 by the CPU's bfloat16 products
            # unless activations=float32 asks for float32 arithmetic; float16 read as it is
            quantize = (16, cfg.group_size, torch.float32, None, None, False,
                        cfg.activations == "auto", half)
        # where each timed choice's times came from (backends/choice_cache.py): describe()'s
        # `choices`, "cache" or "timed"
        with choice_cache.recording() as self.choices:
            self.lean = self._lean_forward(cfg.forward, role, cfg.device_map, quantize,
                                           cfg.huge_pages)
        if quantize is not None:
            self.weights = self._quantized(*quantize[:3], from_file=blocks is not None,
                                           head_from_file=blocks is not None
                                           and (-1, 0) in blocks[0])
            if half_file is not None:
                self.weights = (f"the file's {str(half_file)[6:]} weights as they are: "
                                f"{self.weights}")
        self.num_layers = num_layers
        self.hidden_size = config.hidden_size
        self.graphs = None                  # a GraphRunner once tune() knows the fullest pass
        if cfg.graphs and (self.lean is None or self.window is not None):
            why = "a sliding window" if self.lean is not None and self.window is not None \
                else "no lean forward (model.forward=hf, or an architecture it does not cover)"
            raise ConfigError(f"{role}.graphs=true runs the lean forward's static step, and "
                              f"{self.path!r} has {why}; use {role}.graphs=false")
        self._want_graphs = bool(cfg.graphs)

    def gguf_file(self) -> str | None:
        """The GGUF file this model was converted from (its folder records it), or None."""
        from specflow.backends.hf.gguf import SOURCE

        source = pathlib.Path(self.model.name_or_path) / SOURCE        # a converted folder
        return source.read_text().strip() if source.is_file() else None

    def _file_half(self, cfg) -> torch.dtype | None:
        """dtype=auto on a GGUF file whose layers' products are all BF16 (or all F16), on a CPU
        where the native kernel holds 16-bit weights (quantized.bf16_weight_only): the file's
        precision is that 16-bit type's, held in it (bfloat16 as dtype=bfloat16 holds it, float16
        read against float32 inputs: the values exactly, no float32 copy kept), not widened to
        float32; None elsewhere."""
        from specflow.backends.lean import native
        from specflow.backends.lean.forward import unsupported_reason
        from specflow.backends.lean.gguf_blocks import file_types, other_layer_types

        file = self.gguf_file()
        if cfg.forward == "hf" or file is None or unsupported_reason(self.model.config) \
                is not None or not bf16_weight_only("bfloat16", cfg.activations, self.device,
                                                    cfg.device_map):
            return None
        try:
            types = other_layer_types(file_types(file))
        except (OSError, ValueError):
            return None
        if types == ["BF16"]:
            return torch.bfloat16
        return torch.float16 if types == ["F16"] and native.available(torch.float16) else None

    def _file_blocks(self, cfg) -> tuple[dict, int] | None:
        """dtype=auto on a GGUF file whose layers are all of held_types(), on a CPU, with the
        lean forward: the blocks for LeanLlama.quantize(given=...), and the head's bits (8 where
        the file's head or tied embedding is Q8_0 or wider, else 4); None elsewhere (the
        checkpoint's own dtype, as for any folder)."""
        from specflow.backends.hf.file_products import read_tensors
        from specflow.backends.lean.forward import unsupported_reason
        from specflow.backends.lean.gguf_blocks import (file_types, head_blocks, held_types,
                                                         layer_blocks, matches,
                                                         other_layer_types)

        file = self.gguf_file()
        if self.device.type != "cpu" or cfg.forward == "hf" or cfg.device_map \
                or file is None or unsupported_reason(self.model.config) is not None:
            return None
        try:
            types = file_types(file)
        except (OSError, ValueError):
            return None
        held = other_layer_types(types)
        if any(kind not in ("F32", "F16", "BF16") for kind in held):
            # quantized blocks the layout cannot hold: say so (the user expects the file's
            # precision and gets float)
            self.weights = (f"{', '.join(held)} layers kept as {str(self.model.dtype)[6:]}: "
                            f"dtype=auto holds {', '.join(held_types())} blocks as they are, "
                            f"not these; dtype=int8 or dtype=int4 quantizes them from their "
                            f"values")
            print(f"specflow: note: {pathlib.Path(file).name}: {self.weights}", file=sys.stderr,
                  flush=True)
            return None
        if held:                                   # float layers: the float path is the file's
            return None
        c = self.model.config
        names = [f"model.layers.0.{part}.weight" for part in
                 ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.down_proj")]
        if self.products_from_file:          # not in the model: the folder's values
            try:
                values = read_tensors(self.model.name_or_path, names)
            except (OSError, KeyError, ValueError):
                return None
            q, k, v, down = (values[n] for n in names)
        else:
            q, k, v, down = (self.model.get_parameter(n) for n in names)
        dense = torch.cat([q, k, v])
        for rotary_order in (c.model_type == "llama", c.model_type != "llama"):
            try:
                blocks = layer_blocks(file, c.num_hidden_layers, c.num_attention_heads,
                                      getattr(c, "num_key_value_heads", None)
                                      or c.num_attention_heads, rotary_order)
            except (OSError, ValueError):
                return None
            if blocks is None:
                return None
            if matches(blocks[(0, 1)], dense) and matches(blocks[(0, 7)], down):
                break
        else:
            return None                            # a row order this reader does not know
        head = head_blocks(file)          # the file's own head blocks (native kernel only)
        lm_head = self.model.lm_head.weight
        if head is not None and matches(head, lm_head, rows=min(64, len(lm_head))):
            blocks[(-1, 0)] = head
        kind = types.get("output.weight", types.get("token_embd.weight", "F32"))
        return blocks, 4 if kind in ("Q4_0", "Q4_1") else 8

    def _quantized(self, bits: int, group_size: int, activations: torch.dtype,
                   from_file: bool, head_from_file: bool = False) -> str:
        """Where no lean forward runs, transformers' own linears quantized (the lean forward
        quantized its own); what metrics.json says the products read."""
        from specflow.backends.lean.quantized import QuantizedLinear, quantize_linears

        if self.lean is None:
            left = quantize_linears(self.model, bits, group_size)
            self.model.to(activations)
            held = [m.weight_q for m in self.model.modules() if isinstance(m, QuantizedLinear)]
        else:
            left = self.lean.quantized_left
            held = [layer[f] for layer in self.lean.layers for f in (1, 3, 6, 7)
                    if not isinstance(layer[f], torch.Tensor)]
        kinds = sorted({w.describe() for w in held}) or ["none quantized"]
        described = f"{'; '.join(kinds)}, {str(activations)[6:]} activations"
        if left:
            described += f"; dense (a shape int4 cannot tile): {', '.join(left)}"
        if from_file:
            head = self.lean.lm_head
            described = f"the file's blocks as they are: {described}" + (
                ", the LM head in the file's own blocks" if head_from_file
                else ", the LM head in int8 from its Q8_0 values" if head.bits == 8 else "")
        return described

    def _lean_forward(self, choice: str, role: str, device_map: str | None,
                      quantize: tuple | None = None, huge_pages: bool = False):
        from specflow.backends.lean.forward import LeanLlama, unsupported_reason

        if choice == "hf":
            return None
        reason = unsupported_reason(self.model.config)
        if reason is None and device_map:
            reason = f"device_map={device_map} (layers on several devices)"
        if reason is None:
            self._bool_mask = True
            return LeanLlama(self.model, quantize=quantize, huge_pages=huge_pages)
        if choice == "lean":
            raise ConfigError(f"{role}.forward=lean does not support {self.path!r}: {reason}; "
                              f"use {role}.forward=hf")
        return None

    def tune(self, rows: int, positions: int, settings=None) -> None:
        """As its config group says (`threads`, `native`, `pack`: model.* for the target,
        draft.* for a draft model). The target: `threads` (auto: all cores or one, timed;
        backends/threads.py), then `native` (auto: the native pass where the product pick left
        it out and it measures faster at a one-row pass and the fullest, `positions` in each of
        `rows` rows; backends/lean/native_choice.py), then `pack` (auto: packed when those two
        passes run faster so; backends/lean/packing.py). A draft model: `native`, and `pack`
        timed at its steps of 1, 2, 4, ... rows and its fullest. Only the lean forward on a CPU
        has anything to choose; elsewhere a number of threads is still applied."""
        from specflow.backends import choice_cache
        from specflow.backends.choice import decide, record

        with choice_cache.recording(self.choices):      # beside the product pick's
            for name, plan in self.choice_plans():
                setting = self.settings[name]
                chosen = plan(self, setting, positions, rows)
                self.chosen[name] = record(chosen, decide(chosen))
        self.threads = self.chosen.get("threads", self.threads)
        self.packed = self.chosen["pack"]
        if self._want_graphs:     # static steps up to the fullest pass, in power-of-two buckets
            from specflow.backends.lean.graph_step import GraphRunner

            self.graphs = GraphRunner(self.lean, self.cache, self.device, rows, positions)
            self.bucket = self.graphs.bucket

    def choice_plans(self) -> list:
        """The choices tune() makes, in order, as (setting name, plan): a target's threads, then
        native, then pack; a draft model's native, then its pack (backends/choice.py). Each plan
        reads the state the earlier ones left (its key holds it)."""
        from specflow.backends import threads
        from specflow.backends.lean import native_choice, packing

        if self.role == "draft":
            return [("native", native_choice.plan), ("pack", packing.plan_draft)]
        return [("threads", threads.plan), ("native", native_choice.plan), ("pack", packing.plan)]

    def choice_key(self) -> dict:
        """What a pass of this backend costs depends on besides the machine, for the times
        kept on disk (backends/choice_cache.py): the model's files, its dtype, the cache's slots
        and capacity, and the state the choices made so far left (threads, which are torch's
        own until tune() chooses them, product forms, layout, native passes: describe())."""
        from specflow.backends import choice_cache

        state = {k: v for k, v in self.describe().items() if k != "choices"}
        return {"model": choice_cache.files(self.model.name_or_path),
                "dtype": str(self.model.dtype), "slots": self.cache.slots,
                "capacity": self.cache.max_capacity, "window": self.window, "state": state}

    def describe(self) -> dict:
        """forward (lean | hf), threads (tune's choice for the target; otherwise torch's CPU
        threads now), packed (tune's choice), kernels (the product forms the lean forward
        timed and chose; None without it), native_pass (the pass sizes that run all decoder
        layers in one native call, backends/lean/native_pass.py; None where none do),
        huge_pages_mb (the lean forward's weights in 2 MB pages: model.huge_pages) and choices
        (each timed choice -> "cache" where its times were read back from an earlier run's,
        "timed" where they were measured now: backends/choice_cache.py)."""
        threads = self.threads if self.threads is not None else torch.get_num_threads()
        out = {"forward": "lean" if self.lean is not None else "hf",
               "threads": threads, "packed": bool(self.packed),
               "kernels": self.lean.kernels.describe() if self.lean is not None else None}
        if self.weights is not None:
            out["weights"] = self.weights
        if self.lean is not None:
            out["native_pass"] = self.lean.native_pass_rows()
            # MB of weights copied into transparent huge pages (model.huge_pages)
            out["huge_pages_mb"] = round(self.lean.huge_page_bytes / 2**20, 1)
        if self.lean is not None and self.lean.grouped_from is not None:
            out["attention"] = (f"one query: grouped products from {self.lean.grouped_from} "
                                f"keys, rows x cached length (kernels.pick_one_query_attention)")
        if self.chosen:
            out["chosen"] = dict(self.chosen)
        if self.choices:
            out["choices"] = dict(sorted(self.choices.items()))
        if self.graphs is not None:
            out["graphs"] = {"captured": self.graphs.capture,
                             "buckets": sorted(self.graphs.steps),
                             "capture_seconds": round(self.graphs.capture_seconds, 3)}
        return out

    def reset(self, slot: int) -> None:
        self.cache.reset(slot)

    def cache_length(self, slot: int) -> int:
        return self.cache.lengths[slot]

    supports_trees = True
    supports_hidden_states = True     # the inputs of any layer, from the same pass

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def input_embeddings(self) -> torch.Tensor:
        """The embedding table [V, E]; where the lean forward looks it up in the tied head's
        blocks (a GGUF file's, dtype=auto), their values, dense (a copy the caller holds)."""
        if self.lean is not None and self.lean.embed_held is not None:
            return self.lean.embed_held.dequantize().to(self.lean.embed.dtype)        # [V, E]
        return self.model.get_input_embeddings().weight                               # [V, E]

    def decoder_shape(self) -> DecoderShape:
        c = self.model.config
        heads = c.num_attention_heads
        rope = getattr(c, "rope_theta", None) \
            or (getattr(c, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        return DecoderShape(
            hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(c, "num_key_value_heads", None) or heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
            rms_norm_eps=float(c.rms_norm_eps), rope_theta=float(rope),
            max_position_embeddings=int(getattr(c, "max_position_embeddings", 2048)))

    def output_head(self) -> torch.Tensor:
        """Dense: a packed layout (pack=auto) is undone first, as train-head reads it after
        decoding its data; an int8/int4 head is given as its values (the model stays
        quantized)."""
        if self.lean is not None and self.lean.quantized is not None:
            head = self.lean.lm_head
            return head if isinstance(head, torch.Tensor) else \
                head.dequantize().to(self.lean.embed.dtype)                           # [V, E]
        if self.lean is not None:
            self.lean.unpack()
        return self.model.get_output_embeddings().weight                              # [V, E]

    def final_norm(self) -> torch.Tensor | None:
        norm = getattr(getattr(self.model, "model", None), "norm", None)
        return None if norm is None else norm.weight                                   # [E]

    # (rows, positions) -> the padded sizes a plan is run at; None: exact (CPU: eager passes,
    # padding would be computed for nothing). A CUDA-graph backend sets buckets.
    bucket = None

    @torch.inference_mode()
    def forward(self, slots: torch.Tensor, input_ids: torch.Tensor,
                input_lens: torch.Tensor, hidden_layers: tuple[int, ...] = (),
                logits: bool = True, tree=None):
        """The Backend contract's forward; `logits=False` skips the LM head (a prefill: returns
        None, or (None, hidden)); `tree` (TreeAttention) places and masks tree nodes."""
        slot_list = slots.tolist()
        plan = make_plan(slot_list, [self.cache.lengths[s] for s in slot_list], input_ids,
                         input_lens.tolist(), self.device, tree, self.bucket)
        return self.run(plan, tuple(hidden_layers), logits)

    @torch.inference_mode()
    def run(self, plan: ForwardPlan, hidden_layers: tuple[int, ...] = (), logits: bool = True):
        """Run a plan (backends/plan.py) -> logits [B, T, V] float32 (None with logits=False) and,
        with hidden_layers, the inputs of those layers [B, T, nE] (the real rows and positions
        of a padded plan)."""
        if self.graphs is not None and self.graphs.takes(plan, hidden_layers, logits):
            return self.graphs.run(plan)                                             # [B, T, V]
        self.cache.begin(plan)
        mask = self._mask(plan)
        ids, positions = plan.input_ids, plan.positions                               # [Bp, Tp]
        B, T = plan.rows, plan.width
        layers = tuple(sorted(hidden_layers))
        if self.lean is not None:
            captured: list[torch.Tensor] = []
            # the mask is the plan's own (causal, or its tree's): no window, no bucket padding
            plan_mask = plan.shape == (B, T) and not self._windowed(plan)
            out = self.lean(ids, positions, mask, self.cache, capture=layers, captured=captured,
                            plan_mask=plan_mask, logits=logits)   # a prefill: no LM head, None
            self.cache.commit(plan.slot_list, plan.lens)
            if out is not None and (out.shape[:2] != (B, T) or out.dtype != torch.float32):
                out = out[:B, :T].float()                                            # [B, T, V]
            # the lean forward hands them out in layer order (the contract's ascending order)
            return (out, torch.cat(captured, -1)[:B, :T]) if layers else out         # [B, T, nE]
        extra = {self._cache_kw: self.cache}
        if not logits and self._keeps_logits:
            extra["logits_to_keep"] = 1      # prefill: skip the LM head over the whole prompt
        out = self.model(input_ids=ids, position_ids=positions, attention_mask=mask,
                         use_cache=True, output_hidden_states=bool(layers), **extra)
        self.cache.commit(plan.slot_list, plan.lens)
        scores = out.logits[:B, :T].float() if logits else None                      # [B, T, V]
        if layers:     # hidden_states[i] is the input of layer i (i < num_layers)
            return scores, torch.cat([out.hidden_states[i] for i in layers], -1)[:B, :T]
        return scores

    def _windowed(self, plan: ForwardPlan) -> bool:
        """Mistral's sliding window cuts keys from this plan's queries (its keys outnumber it)."""
        return self.window is not None and plan.kv_len > self.window

    def _mask(self, plan: ForwardPlan) -> torch.Tensor | None:
        """The attention mask of a plan, [Bp, 1, Tp, kv_len] (bool, or additive for eager
        attention), or None where one query attends to its whole cached row."""
        tree, kv_len = plan.tree, plan.kv_len
        Bp, Tp = plan.shape
        windowed = self._windowed(plan)
        # one query attending to the whole cached row (a tree node whose row holds only its
        # ancestors: a priced tree that is a chain so far) needs no mask
        if Bp == 1 and Tp == 1 and not windowed and (tree is None or (
                kv_len == tree.visible_below[0] + tree.see.shape[2] and bool(tree.see.all()))):
            return None
        if tree is not None:
            allowed = tree.allowed(kv_len, self.window).to(self.device)               # [B, T, L]
            if allowed.shape[:2] != (Bp, Tp):      # a padded plan: padding queries see key 0
                pad = torch.zeros(Bp, Tp, kv_len, dtype=torch.bool, device=self.device)
                pad[..., 0] = True
                pad[:allowed.shape[0], :allowed.shape[1]] = allowed
                allowed = pad
        else:
            keys = torch.arange(kv_len, device=self.device)                           # [L]
            allowed = keys[None, None, :] <= plan.positions[:, :, None]              # [Bp, Tp, L]
            if windowed:
                allowed &= keys[None, None, :] > plan.positions[:, :, None] - self.window
        if self._bool_mask:
            return allowed[:, None]
        return torch.zeros(Bp, 1, Tp, kv_len, dtype=self.model.dtype, device=self.device
                           ).masked_fill(~allowed[:, None], torch.finfo(self.model.dtype).min)

    @torch.inference_mode()
    def keep_cached(self, slots: list[int], base: list[int], picks: list[list[int]]) -> None:
        self.cache.move_path_into_place(slots, base, picks)

    def prefill(self, slot: int, ids: list[int]) -> None:
        self.prefill_many([slot], [ids])

    def prefill_many(self, slots: list[int], prompts: list[list[int]],
                     hidden_layers: tuple[int, ...] = ()):
        """The prompts in as few ragged forwards as fit PREFILL_TOKENS padded tokens each
        (longest first, so rows of a forward have similar lengths and little padding).
        With hidden_layers: -> the states of each forward (HiddenStates, one per forward)."""
        order = sorted((i for i, ids in enumerate(prompts) if ids), key=lambda i: -len(prompts[i]))
        groups: list[list[int]] = []
        for i in order:    # a group's width is its first (longest) prompt
            if groups and len(prompts[groups[-1][0]]) * (len(groups[-1]) + 1) <= PREFILL_TOKENS:
                groups[-1].append(i)
            else:
                groups.append([i])
        states = []
        for group in groups:
            ids = torch.full((len(group), len(prompts[group[0]])), PAD, dtype=torch.long)  # [G, T]
            for row, j in enumerate(group):
                ids[row, :len(prompts[j])] = torch.tensor(prompts[j])
            rows = [slots[j] for j in group]
            lens = [len(prompts[j]) for j in group]
            starts = [self.cache.lengths[s] for s in rows]
            out = self.forward(torch.tensor(rows), ids, torch.tensor(lens), hidden_layers,
                               logits=False)
            if hidden_layers:
                states.append(HiddenStates(rows, starts, lens, out[1], tuple(sorted(hidden_layers))))
        return states if hidden_layers else None

    def truncate(self, slots: torch.Tensor, lengths: list[int]) -> None:
        self.cache.truncate(slots.tolist(), lengths)

    @torch.inference_mode()
    def greedy_steps(self, slots: list[int], fed: list[list[int]], steps: list[int],
                     vocab_size: int, min_confidence: float | None = None
                     ) -> torch.Tensor | None:
        """Greedy draft steps as one native call (backends/lean/native_chain.py): row r feeds
        fed[r], then steps[r] - 1 times the token it found -> [R, max(steps)] long (-1 past a
        row's steps, or past its first token under `min_confidence`), each step's argmax over
        the first `vocab_size` logits, the fed tokens cached; None where the native steps do not
        run (the caller steps through forward())."""
        if self.lean is None or self.graphs is not None or self.device.type != "cpu" \
                or self.window is not None and max(
                    self.cache.lengths[s] + len(f) + n for s, f, n in zip(slots, fed, steps)
                ) > self.window:
            return None
        from specflow.backends.lean.native_chain import chain

        out = chain(self.lean, self.cache, slots, fed, steps, vocab_size, min_confidence)
        if out is not None:     # the fed tokens, and each step's token but the last
            taken = (out >= 0).sum(1).tolist() if min_confidence else steps   # cpu only
            self.cache.commit(slots, [len(f) + n - 1 if n else 0 for f, n in zip(fed, taken)])
        return out

    def can_adopt_cache(self, source: "HFBackend") -> str | None:
        """None where this model's cache can take `source`'s keys and values as its own (the
        same layers, attention shapes, rotary positions and context), else why not."""
        mine, theirs = self.decoder_shape(), source.decoder_shape()
        for what in ("num_key_value_heads", "head_dim", "rope_theta"):
            if getattr(mine, what) != getattr(theirs, what):
                return f"{what} {getattr(mine, what)} against {getattr(theirs, what)}"
        if self.num_layers != source.num_layers or self.cache.slots < source.cache.slots:
            return f"{self.num_layers} layers x {self.cache.slots} slots against " \
                   f"{source.num_layers} x {source.cache.slots}"
        if self.max_length != source.max_length:
            return f"a context of {self.max_length} positions against {source.max_length}"
        return None

    @torch.inference_mode()
    def adopt_cache(self, source: "HFBackend", slots: list[int], ends: list[int]) -> None:
        """Cache each slot's positions from this cache's length up to ends[i] with the keys and
        values `source` computed for them (can_adopt_cache(source) is None; source holds them):
        no pass of this model. The buffers are made by the first pass that writes them, in this
        model's dtype and layout, so a fresh cache runs one pass of one token first."""
        if not any(end > self.cache.lengths[s] for s, end in zip(slots, ends)):
            return
        if any(buf is None for buf in (*self.cache.keys, *self.cache.values)):
            s = slots[0]
            start = self.cache.lengths[s]
            self.forward(torch.tensor([s]), torch.zeros(1, 1, dtype=torch.long),
                         torch.ones(1, dtype=torch.long), logits=False)
            self.cache.truncate([s], [start])          # its entry is overwritten below
        self.cache.copy_from(source.cache, slots, ends)


def check_same_tokenizer(target: HFBackend, draft: HFBackend) -> None:
    """A draft must share the target's tokenizer: vocabulary, special tokens, encodings."""
    from specflow.backends.hf.tokenizers import compare_tokenizers

    problems = compare_tokenizers(target.tokenizer.tok, draft.tokenizer.tok)
    if problems:
        raise ConfigError(f"draft {draft.path!r} does not share the tokenizer of target "
                          f"{target.path!r} ({'; '.join(problems)}); pick a draft from the "
                          f"target's family")
