"""A model read from a GGUF file whose layer products will be the file's own blocks
(`dtype=auto` on a CPU, backends/lean/gguf_blocks.py), built without their float32 weights.

transformers builds a GGUF model from the float32 folder the file was converted to
(backends/hf/gguf.py): every weight dequantized, 540 MB for SmolLM2-135M (28 GB for a 7B file),
most of it then replaced by the file's blocks. Here the model is built on the meta device
(accelerate's init_empty_weights) and only the tensors the blocks do not replace are read from
the folder: the embedding, the norms, biases and an untied LM head. Each product weight
(q/k/v/o, gate/up/down) is a one-element placeholder of its shape, what the lean forward leaves
after holding a weight in another layout (LeanLlama.quantize), so the model is in the state it
would reach after loading and quantizing, without the float32 copy in between.

`file_model.load_light` goes one step further and builds that model without transformers' model classes
(backends/hf/file_model.py: their import alone is ~95 MB of a ~450 MB SmolLM2 run); `load`, the
transformers-built model on the meta device, serves a folder the shell does not (a scaled
rope, remote code, a folder missing a tensor the lean forward reads).

Only where every layer product will be held: the lean forward covers the architecture, the
native kernel builds, the file's layer types are all held (gguf_blocks.held_types), on a CPU,
without device_map. If the blocks then do not match the folder's values (a row order the
reader does not know: HFBackend._file_blocks checks), the backend loads the float32 model after
all.
"""
from __future__ import annotations

import json
import pathlib
import struct

import torch

from specflow.backends.lean.forward import is_placeholder, placeholder  # noqa: F401

PRODUCTS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tensor_files(folder: pathlib.Path) -> dict[str, pathlib.Path]:
    """Each tensor's safetensors file in a folder (one file, or shards and their index)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return {name: folder / file
                for name, file in json.loads(index.read_text())["weight_map"].items()}
    from safetensors import safe_open

    single = folder / "model.safetensors"
    with safe_open(str(single), "pt") as f:
        return {name: single for name in f.keys()}


def header(file: pathlib.Path) -> tuple[int, dict]:
    """A safetensors file's header size and its tensors' {name: {dtype, shape, data_offsets}}."""
    with open(file, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        info = json.loads(f.read(size))
    info.pop("__metadata__", None)
    return size, info


def read_tensors(folder: str, names: list[str]) -> dict[str, torch.Tensor]:
    """The named tensors of a saved folder, read alone (safetensors reads only their bytes)."""
    from safetensors import safe_open

    files = tensor_files(pathlib.Path(folder))
    out = {}
    for file in sorted({files[n] for n in names}, key=str):
        with safe_open(str(file), "pt") as f:
            out.update({n: f.get_tensor(n) for n in names if files[n] == file})
    return out


def mapped_tensor(folder: str, name: str) -> torch.Tensor | None:
    """A float32 tensor of a saved folder mapped from its file (copy-on-write), not read: its
    pages come in as rows are touched and stay the file's. None where it is not a float32
    tensor of a safetensors file (read it then). The embedding of a model whose tied head is
    held in the file's blocks is looked up in those blocks and freed once 257 of its rows are
    checked (LeanLlama._share_embedding): read, its 113 MB (SmolLM2) were the load's peak."""
    import numpy as np

    file = tensor_files(pathlib.Path(folder)).get(name)
    if file is None:
        return None
    size, tensors = header(file)
    info = tensors.get(name, {})
    if info.get("dtype") != "F32":
        return None
    begin, end = info["data_offsets"]
    shape = tuple(info["shape"])
    if end - begin != 4 * int(np.prod(shape, dtype=np.int64)):
        return None
    return torch.from_numpy(np.memmap(file, np.float32, "c", 8 + size + begin, shape))


def release_freed() -> None:
    """Hand the C heap's freed pages back to the system (glibc's malloc_trim; nothing
    elsewhere): the blocks' loading frees ~1.5x their bytes of temporaries, which glibc keeps
    for reuse otherwise (SmolLM2: ~80 MB of a ~700 MB process)."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):
        pass


def wanted(cfg, folder: str, config, device: torch.device) -> bool:
    """Whether the model in `folder` (a converted GGUF file) will hold every layer product in
    the file's blocks, so that their float32 weights need not be read."""
    from specflow.backends.hf.gguf import SOURCE
    from specflow.backends.lean import blocks
    from specflow.backends.lean.forward import unsupported_reason
    from specflow.backends.lean.gguf_blocks import file_types, other_layer_types

    source = pathlib.Path(folder) / SOURCE
    if cfg.dtype != "auto" or device.type != "cpu" or cfg.device_map or cfg.forward == "hf" \
            or not source.is_file() or unsupported_reason(config) is not None \
            or not blocks.available():
        return False
    try:
        import accelerate  # noqa: F401
        types = file_types(source.read_text().strip())
    except (ImportError, OSError, ValueError):
        return False
    layers = {name.split(".")[1] for name in types if name.startswith("blk.")}
    return len(layers) == config.num_hidden_layers and not other_layer_types(types)


def load(folder: str, config, attn_implementation: str):
    """The model in `folder` with each layer product a placeholder and every other tensor read
    from the folder (tied weights tied again, the generation config read)."""
    from accelerate import init_empty_weights
    from accelerate.utils import set_module_tensor_to_device
    from transformers import AutoModelForCausalLM, GenerationConfig

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation,
                                                 dtype=torch.float32)
    tied = getattr(config, "tie_word_embeddings", False)
    head = model.get_output_embeddings().weight
    params = {n: p for n, p in model.named_parameters() if not (tied and p is head)}
    products = {n for n in params if n.endswith(".weight") and n.split(".")[-2] in PRODUCTS}
    mapped = {}                  # a tied embedding: mapped, not read (mapped_tensor says why)
    embedding = next((n for n, p in params.items() if p is model.get_input_embeddings().weight),
                     None) if tied else None
    if embedding is not None and (table := mapped_tensor(folder, embedding)) is not None:
        mapped[embedding] = table
    read = {**read_tensors(folder, [n for n in params if n not in products and n not in mapped]),
            **mapped}
    for name, p in params.items():
        value = placeholder(p.shape, torch.float32) if name in products else read[name]
        set_module_tensor_to_device(model, name, "cpu", value=value)
    if tied:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"{folder}: no weights for {', '.join(left[:3])}")
    if (pathlib.Path(folder) / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder)
    return model.eval()
