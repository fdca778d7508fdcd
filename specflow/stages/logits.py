"""Logit processors: each edits ShapingBatch.logits [B, P, V] for every shaped position.

The same processors, in config order, shape the draft's logits at each draft step and the target's
at each of the K+1 verified positions (Pipeline.shape), so sampling settings can never apply to one
and not the other. Selecting `temperature` (> 0), `top_k`, `top_p` or `min_p` switches sampling on;
with none of them (or temperature 0) decoding is greedy and the sampling processors are skipped,
since they cannot change the argmax.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specflow.errors import ConfigError
from specflow.plugins import hookimpl

NEG_INF = float("-inf")


# --- the tensor work: plain functions over [..., V] ---------------------------------------------

def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return logits / temperature                                               # [..., V]


def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    if k >= logits.shape[-1]:
        return logits
    kth = logits.topk(k, dim=-1).values[..., -1:]                             # [..., 1]
    return logits.masked_fill(logits < kth, NEG_INF)


# widths of the most likely tokens tried before a row is sorted whole (apply_top_p)
TOP_P_WIDTHS = (64, 1024)


def apply_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep each row's smallest set of most likely tokens whose mass reaches p: the i-th most
    likely stays iff the mass of those before it is < p (so the first always stays).

    On a CPU, most rows reach p within a few dozen tokens, so the most likely 64 are found by
    `topk` (one pass over V) and a row is taken wider (1024, then a whole sort) only where they
    do not reach p: a sort of every row was a third of a sampled EAGLE tree round on the demo
    pair. Elsewhere one sort of every row (no data-dependent step, so no sync)."""
    if p >= 1.0:
        return logits
    if logits.device.type != "cpu":
        return _top_p_sorted(logits, p)
    flat = logits.reshape(-1, logits.shape[-1])                                 # [N, V]
    V = flat.shape[-1]
    lse = flat.logsumexp(-1, keepdim=True)                                     # [N, 1]
    out = torch.full_like(flat, NEG_INF)                                       # [N, V]
    rows = None                                                                # all of them
    for width in (*(w for w in TOP_P_WIDTHS if w < V), V):
        x, m = (flat, lse) if rows is None else (flat[rows], lse[rows])        # [n, V], [n, 1]
        top, idx = x.topk(width, dim=-1) if width < V else x.sort(dim=-1, descending=True)
        probs = (top - m).exp()                                                # [n, w] descending
        cum = probs.cumsum(-1)                                                 # [n, w]
        keep = torch.where((cum - probs) < p, top, NEG_INF)                    # [n, w]
        # a row is decided where its w tokens' mass reaches p: every token past them has >= p
        # before it; the others write nothing now (-inf where out already is -inf)
        wider = cum[:, -1] < p if width < V else torch.zeros_like(cum[:, -1], dtype=torch.bool)
        keep = keep.masked_fill(wider[:, None], NEG_INF)
        if rows is None:
            out.scatter_(-1, idx, keep)
        else:
            out[rows] = out[rows].scatter(-1, idx, keep)
        if not wider.any():                                                    # cpu only
            break
        rows = wider.nonzero()[:, 0] if rows is None else rows[wider]          # cpu only
    return out.reshape(logits.shape)


def _top_p_sorted(logits: torch.Tensor, p: float) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)               # [..., V]
    cum = sorted_logits.softmax(-1).cumsum(-1)                                 # [..., V]
    # keep the smallest prefix whose mass reaches p (the first token always stays)
    drop_sorted = (cum - sorted_logits.softmax(-1)) >= p                       # [..., V]
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, NEG_INF)


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    probs = logits.softmax(-1)                                                 # [..., V]
    threshold = min_p * probs.amax(-1, keepdim=True)                           # [..., 1]
    return logits.masked_fill(probs < threshold, NEG_INF)


# --- configs and stages ----------------------------------------------------------------------

@dataclass
class TemperatureConfig:
    name: str = "temperature"
    value: float = 1.0

    def __post_init__(self) -> None:
        if not self.value >= 0:
            raise ConfigError(f"logits.temperature.value={self.value} must be >= 0 "
                              f"(0 = greedy); set a non-negative temperature")


@dataclass
class TopKConfig:
    name: str = "top_k"
    k: int = 50

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ConfigError(f"logits.top_k.k={self.k} must be >= 1; drop top_k from logits "
                              f"to disable it")


@dataclass
class TopPConfig:
    name: str = "top_p"
    p: float = 0.9

    def __post_init__(self) -> None:
        if not 0.0 < self.p <= 1.0:
            raise ConfigError(f"logits.top_p.p={self.p} must be in (0, 1]; use 1.0 to keep "
                              f"every token")


@dataclass
class MinPConfig:
    name: str = "min_p"
    p: float = 0.05

    def __post_init__(self) -> None:
        if not 0.0 <= self.p <= 1.0:
            raise ConfigError(f"logits.min_p.p={self.p} must be in [0, 1]")


class LogitProcessor:
    """Base for processors: `samples` ones (temperature, top-k/p, min-p) are skipped under greedy.

    A request may set its own value of a configured sampling processor (`ShapingBatch.sampling`,
    from `generate(sampling=...)` or the server): rows with one are shaped with it, the others
    with the config's. Draft and target go through the same call, so each row stays exact.
    """

    samples = True
    key = ""           # the request setting this processor reads (temperature, top_k, ...)
    field = ""         # and its value's name in the processor's config

    def __init__(self, cfg, ctx=None):
        self.cfg = cfg

    def apply(self, logits: torch.Tensor, value) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        return self.apply(logits, getattr(self.cfg, self.field))

    def keeps_argmax(self, request_ids: list[int], sampling, greedy: bool) -> bool:
        """These rows' argmax is the model's after this processor (Pipeline.keeps_argmax): a
        sampling processor in a greedy round leaves the logits alone."""
        return self.samples and greedy

    @hookimpl
    def specflow_process_logits(self, shaping):
        if self.samples and shaping.greedy:
            return      # a greedy round of a pipeline that samples on request: argmax unchanged
        values = shaping.row_values(self.key, getattr(self.cfg, self.field))
        if values is None:
            shaping.logits = self.process(shaping.logits)                      # [B, P, V]
            return
        shaping.logits = torch.stack([self.apply(shaping.logits[b], v)           # [P, V] each
                                      for b, v in enumerate(values)])            # [B, P, V]


def apply_temperature_or_argmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """temperature > 0 divides; 0 (a request asking for greedy in a sampling pipeline) keeps the
    argmax alone, so the row's distribution is one-hot: rejection sampling then accepts a draft
    exactly when it is the target's argmax, which is greedy verification."""
    if temperature > 0:
        return apply_temperature(logits, temperature)
    top = logits.argmax(-1, keepdim=True)                                      # [..., 1]
    return torch.full_like(logits, NEG_INF).scatter(-1, top, 0.0)


class Temperature(LogitProcessor):
    key, field = "temperature", "value"

    def apply(self, logits, value):
        return apply_temperature_or_argmax(logits, float(value))


class TopK(LogitProcessor):
    key, field = "top_k", "k"

    def apply(self, logits, value):
        return apply_top_k(logits, int(value))


class TopP(LogitProcessor):
    key, field = "top_p", "p"

    def apply(self, logits, value):
        return apply_top_p(logits, float(value))


class MinP(LogitProcessor):
    key, field = "min_p", "p"

    def apply(self, logits, value):
        return apply_min_p(logits, float(value))


def has_temperature(logits_cfg) -> bool:
    """Whether the pipeline runs a temperature processor (so a request may set its own)."""
    return any(node.get("name") == "temperature" for node in (logits_cfg or {}).values())


def asks_to_sample(sampling: list[dict | None] | None) -> bool:
    """Whether a row of this round asked for its own temperature above 0."""
    return any(row and row.get("temperature", 0) > 0 for row in sampling or ())


def is_greedy(logits_cfg) -> bool:
    """Greedy unless a sampling processor is selected (temperature 0 keeps it greedy)."""
    if not logits_cfg:
        return True
    temperature = logits_cfg.get("temperature")
    if temperature is not None and float(temperature.value) == 0.0:
        return True
    return not any(node.get("name") in SAMPLING_PROCESSORS for node in logits_cfg.values())


SAMPLING_PROCESSORS = ("temperature", "top_k", "top_p", "min_p")
