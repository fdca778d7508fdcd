"""How a pipeline's parts are built from config: the context component factories receive, the
one function that builds a registered component from its node (the pipeline and specflow's
drafter inside vLLM both call it), the draft model's build and tune, and the checks that run
before any weights load."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from omegaconf import DictConfig

from specflow.backends import choice_cache
from specflow.backends.contract import Backend, SimClock
from specflow.config import option
from specflow.errors import ConfigError
from specflow.plugins import blame, get_registry
from specflow.stages.layout import tree_width


@dataclass
class BuildContext:
    """What component factories receive besides their own config.

    The draft model is built on first use, so `proposer=ngram` never loads one.
    """

    cfg: DictConfig
    slots: int
    clock: SimClock
    device: torch.device
    target: Backend | None = None
    tokenizer: Any = None
    build_draft: Any = field(default=None, repr=False)
    _draft: Any = field(default=None, repr=False)
    # the pipeline's hook relay (its plugin manager's `hook`): a stage calls other stages'
    # hooks through it (a policy asks the proposer what drafting costs)
    hook: Any = field(default=None, repr=False)

    @property
    def draft(self) -> Backend | None:
        if self._draft is None and self.build_draft is not None:
            self._draft, self.build_draft = self.build_draft(), None
        return self._draft


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device={name} but this machine has no CUDA GPU; use device=cpu "
                          f"or device=auto")
    if name.startswith("cuda:") and int(name[5:]) >= torch.cuda.device_count():
        raise ConfigError(f"device={name} but this machine has {torch.cuda.device_count()} CUDA "
                          f"GPU(s), numbered from 0; use device=cuda:0 or device=auto")
    if name == "mps" and not (getattr(torch.backends, "mps", None)
                              and torch.backends.mps.is_available()):
        raise ConfigError("device=mps but this machine has no Apple GPU; use device=cpu or "
                          "device=auto")
    return torch.device(name)


def retiming(cfg: DictConfig):
    """Within: the choices made at start time their ways again where the config says `retime`
    (backends/choice_cache.py)."""
    return choice_cache.retiming(bool(cfg.get("retime", False)))


def build_component(kind: str, node, ctx: BuildContext):
    """The registered component a config node names, built by its factory from its typed config
    (the one way a pipeline, and specflow's drafter inside vLLM, make their stages); an error
    in a plugin's factory names the plugin and its package."""
    component = get_registry().get(kind, node.name)
    obj = option({kind: node}, kind) if component.schema is not None else node
    try:
        return component.factory(obj, ctx)
    except Exception as exc:   # a plugin's factory: name the plugin and its package
        module = getattr(component.factory, "__module__", None)
        blamed = blame(exc, f"building {kind}={node.name}", module, component.plugin)
        if blamed is None:
            raise
        raise blamed from exc


def build_draft(node, ctx: BuildContext):
    """The draft model a `draft` config node names, tuned by itself for its steps: its fullest
    scores a tree's frontier (proposer.topk positions; one for a chain) in every slot. The
    pipeline's `draft` group and proposer=self's copy of the target are both built here."""
    cfg = ctx.cfg
    with retiming(cfg):
        draft = build_component("draft", node, ctx)
        if draft is not None:
            check_tree_width(cfg.get("proposer"), draft.max_length, "the draft model's")
            draft.tune(rows=int(cfg.max_batch_size), positions=tree_width(cfg.get("proposer")),
                       settings=cfg)
    return draft


def preflight(cfg: DictConfig, prompts: list[str] | None = None) -> None:
    """The selected components' checks that need no weights (a draft's tokenizer against the
    target's; the prompts' lengths, when given), run before any model loads: a mistake is one
    line in seconds instead of after minutes of loading."""
    for component in get_registry().selected(cfg):
        if component.preflight is not None:
            component.preflight(cfg, prompts)


def check_tree_width(proposer, limit: int | None, whose: str) -> None:
    """A tree's frontier (proposer.topk nodes per level) is scored in one pass, so it must fit
    the context like the node budget (the draft model's too, when it builds the tree)."""
    width = tree_width(proposer)
    if limit is not None and width > 1 and width + 1 >= limit:
        raise ConfigError(f"proposer.topk={width} leaves no room in {whose} {limit}-token "
                          f"context (a tree level scores up to topk nodes at once); use a tree "
                          f"width well below {limit}, at most proposer.num_draft_tokens")
