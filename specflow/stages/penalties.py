"""Logit processors that read the prefix: penalties, min_new_tokens, no_repeat_ngram, bad_words, bias.

Each shaped position sees its own prefix, committed tokens plus the drafts before it
(ShapingBatch.prefix), so draft and target evaluate exactly what plain decoding would (pitfalls
10-12 in docs/design.md). Token counts are kept per request for the committed tokens (updated in
specflow_sync_cache with every committed token, not one per round) and the drafts visible to each
position are added with one scatter over [B, P, D].
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specflow.errors import ConfigError
from specflow.plugins import hookimpl
from specflow.stages.logits import NEG_INF
from specflow.state import PAD


# --- configs ---------------------------------------------------------------------------------

@dataclass
class RepetitionPenaltyConfig:
    name: str = "repetition_penalty"
    penalty: float = 1.2          # HF semantics: prompt + generated tokens; > 1 discourages

    def __post_init__(self) -> None:
        if not self.penalty > 0:
            raise ConfigError(f"logits.repetition_penalty.penalty={self.penalty} must be > 0 "
                              f"(1 = off)")


@dataclass
class FrequencyPenaltyConfig:
    name: str = "frequency_penalty"
    value: float = 0.5            # OpenAI/vLLM semantics: generated tokens, times their count

    def __post_init__(self) -> None:
        if not -2.0 <= self.value <= 2.0:
            raise ConfigError(f"logits.frequency_penalty.value={self.value} must be in [-2, 2]")


@dataclass
class PresencePenaltyConfig:
    name: str = "presence_penalty"
    value: float = 0.5            # OpenAI/vLLM semantics: generated tokens, once each

    def __post_init__(self) -> None:
        if not -2.0 <= self.value <= 2.0:
            raise ConfigError(f"logits.presence_penalty.value={self.value} must be in [-2, 2]")


@dataclass
class MinNewTokensConfig:
    name: str = "min_new_tokens"
    min_tokens: int = 8           # EOS is forbidden until this many tokens are generated

    def __post_init__(self) -> None:
        if self.min_tokens < 0:
            raise ConfigError(f"logits.min_new_tokens.min_tokens={self.min_tokens} must be >= 0")


@dataclass
class NoRepeatNgramConfig:
    name: str = "no_repeat_ngram"
    size: int = 3                 # no n-gram of this size appears twice (prompt included, as HF)

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ConfigError(f"logits.no_repeat_ngram.size={self.size} must be >= 1")


@dataclass
class BadWordsConfig:
    name: str = "bad_words"
    words: list[str] = field(default_factory=list)          # encoded with the target's tokenizer
    token_ids: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.words and not self.token_ids:
            raise ConfigError("logits.bad_words needs words or token_ids")
        if any(w == "" for w in self.words) or any(not seq for seq in self.token_ids):
            raise ConfigError("logits.bad_words has an empty entry; remove it")


@dataclass
class LogitBiasConfig:
    NEG_INF_OK = ("bias",)        # -inf bans a token (NaN and +inf are refused)
    name: str = "logit_bias"
    bias: dict[int, float] = field(default_factory=dict)    # token id -> added to its logit

    def __post_init__(self) -> None:
        if not self.bias:
            raise ConfigError("logits.logit_bias.bias is empty; give {token_id: bias}")


# --- per-request counts ------------------------------------------------------------------------

class CommittedCounts:
    """Counts of each request's committed tokens [V], kept current as tokens commit."""

    def __init__(self, vocab_size: int, include_prompt: bool):
        self.V = vocab_size
        self.include_prompt = include_prompt
        self.counts: dict[int, torch.Tensor] = {}
        self.seen: dict[int, int] = {}          # committed tokens already counted
        self.prompt_len: dict[int, int] = {}

    def start(self, request) -> None:
        ids = request.prompt_ids
        self.prompt_len[request.request_id] = len(ids)
        counts = torch.zeros(self.V)
        if self.include_prompt:
            counts += torch.bincount(torch.tensor(ids), minlength=self.V)[: self.V].float()
        self.counts[request.request_id] = counts
        self.seen[request.request_id] = len(ids)

    def sync(self, batch) -> None:
        for rid, ids in zip(batch.request_ids, batch.token_ids):
            new = ids[self.seen[rid]:]
            if new:
                self.counts[rid] += torch.bincount(torch.tensor(new), minlength=self.V)[: self.V].float()
                self.seen[rid] = len(ids)

    def end(self, request) -> None:
        for table in (self.counts, self.seen, self.prompt_len):
            table.pop(request.request_id, None)

    def at_positions(self, shaping) -> torch.Tensor:
        """Counts [B, P, V] of the prefix each shaped position sees (committed + visible drafts)."""
        logits = shaping.logits
        B, P, V = logits.shape
        base = torch.stack([self.counts[r] for r in shaping.request_ids]).to(logits.device)  # [B, V]
        counts = base[:, None, :].expand(B, P, V).clone()                                    # [B, P, V]
        D = min(shaping.first_draft_index + P - 1, shaping.draft_token_ids.shape[1])
        if D > 0:
            drafts = shaping.draft_token_ids[:, :D].to(logits.device)                        # [B, D]
            p = torch.arange(P, device=logits.device)[None, :, None]                         # [1, P, 1]
            j = torch.arange(D, device=logits.device)[None, None, :]                         # [1, 1, D]
            visible = (shaping.first_draft_index + p > j) & (drafts[:, None, :] != PAD)     # [B, P, D]
            counts.scatter_add_(2, drafts.clamp(min=0)[:, None, :].expand(B, P, D), visible.float())
        return counts


class PrefixProcessor:
    """Base for processors that can change the argmax: they run under greedy as well."""

    samples = False

    def __init__(self, cfg, ctx):
        self.cfg = cfg


class CountingProcessor(PrefixProcessor):
    """A processor that reads how often each token occurs in the prefix. A request may set its
    own value (`sampling={"frequency_penalty": ...}`, the server's request fields) where the
    pipeline runs the processor; the other rows keep the config's."""

    include_prompt = False
    key = ""           # the request setting (repetition_penalty, frequency_penalty, ...)
    field = ""         # its name in the config

    def __init__(self, cfg, ctx):
        super().__init__(cfg, ctx)
        self.tokens = CommittedCounts(ctx.target.vocab_size, self.include_prompt)

    @hookimpl
    def specflow_request_start(self, slot, request):
        self.tokens.start(request)

    @hookimpl
    def specflow_sync_cache(self, batch, result):
        self.tokens.sync(batch)

    @hookimpl
    def specflow_request_end(self, slot, request, finish_reason):
        self.tokens.end(request)

    def value(self, shaping) -> float | torch.Tensor:
        """The config's value, or [B, 1, 1] per row where requests set their own."""
        own = getattr(self.cfg, self.field)
        values = shaping.row_values(self.key, own)
        if values is None:
            return own
        return torch.tensor(values, dtype=shaping.logits.dtype,
                            device=shaping.logits.device)[:, None, None]             # [B, 1, 1]


class RepetitionPenalty(CountingProcessor):
    include_prompt = True
    key, field = "repetition_penalty", "penalty"

    @hookimpl
    def specflow_process_logits(self, shaping):
        seen = self.tokens.at_positions(shaping) > 0                                   # [B, P, V]
        x, pen = shaping.logits, self.value(shaping)
        shaping.logits = torch.where(seen, torch.where(x > 0, x / pen, x * pen), x)


class FrequencyPenalty(CountingProcessor):
    key, field = "frequency_penalty", "value"

    @hookimpl
    def specflow_process_logits(self, shaping):
        shaping.logits = shaping.logits - self.value(shaping) * self.tokens.at_positions(shaping)


class PresencePenalty(CountingProcessor):
    key, field = "presence_penalty", "value"

    @hookimpl
    def specflow_process_logits(self, shaping):
        seen = (self.tokens.at_positions(shaping) > 0).float()
        shaping.logits = shaping.logits - self.value(shaping) * seen


class MinNewTokens(PrefixProcessor):
    def __init__(self, cfg, ctx):
        super().__init__(cfg, ctx)
        target = ctx.target
        self.eos = sorted(target.ends())
        self.prompt_len: dict[int, int] = {}

    @hookimpl
    def specflow_request_start(self, slot, request):
        self.prompt_len[request.request_id] = len(request.prompt_ids)

    @hookimpl
    def specflow_request_end(self, slot, request, finish_reason):
        self.prompt_len.pop(request.request_id, None)

    @hookimpl
    def specflow_process_logits(self, shaping):
        if not self.eos:
            return
        B, P, _ = shaping.logits.shape
        generated = torch.tensor([len(ids) - self.prompt_len[r]
                                  for ids, r in zip(shaping.token_ids, shaping.request_ids)])
        real = (torch.tensor(shaping.draft_id_lists(), dtype=torch.long) != PAD).long()  # [B, D]
        seen = torch.cat([torch.zeros(B, 1, dtype=torch.long), real.cumsum(1)], 1)       # [B, D+1]
        cols = (shaping.first_draft_index + torch.arange(P)).clamp(max=seen.shape[1] - 1)
        at = generated[:, None] + seen[:, cols]                                          # [B, P]
        block = (at < self.cfg.min_tokens).to(shaping.logits.device)                      # [B, P]
        logits = shaping.logits.clone()
        logits[..., self.eos] = logits[..., self.eos].masked_fill(block[..., None], NEG_INF)
        shaping.logits = logits


class NoRepeatNgram(PrefixProcessor):
    """HF's no_repeat_ngram_size, per position; an index of committed n-grams per request."""

    def __init__(self, cfg, ctx):
        super().__init__(cfg, ctx)
        self.n = cfg.size
        self.follow: dict[int, dict[tuple, set[int]]] = {}
        self.indexed: dict[int, int] = {}

    def _index(self, rid: int, ids: list[int]) -> None:
        table, n = self.follow.setdefault(rid, {}), self.n
        start = self.indexed.get(rid, 0)
        for end in range(max(start, n - 1), len(ids)):          # n-gram ids[end-n+1 .. end]
            table.setdefault(tuple(ids[end - n + 1:end]), set()).add(ids[end])
        self.indexed[rid] = len(ids)

    @hookimpl
    def specflow_request_start(self, slot, request):
        self.follow.pop(request.request_id, None)
        self.indexed.pop(request.request_id, None)
        self._index(request.request_id, request.prompt_ids)

    @hookimpl
    def specflow_sync_cache(self, batch, result):
        for rid, ids in zip(batch.request_ids, batch.token_ids):
            self._index(rid, ids)

    @hookimpl
    def specflow_request_end(self, slot, request, finish_reason):
        self.follow.pop(request.request_id, None)
        self.indexed.pop(request.request_id, None)

    def banned(self, rid: int, committed: list[int], drafts: list[int]) -> set[int]:
        n = self.n
        seq = committed + drafts
        if len(seq) < n - 1:
            return set()
        key = tuple(seq[len(seq) - n + 1:]) if n > 1 else ()
        out = set(self.follow.get(rid, {}).get(key, ()))
        # n-grams that end inside the drafts are not in the committed index yet
        for end in range(max(len(committed), n - 1), len(seq)):
            if tuple(seq[end - n + 1:end]) == key:
                out.add(seq[end])
        return out

    @hookimpl
    def specflow_process_logits(self, shaping):
        B, P, _ = shaping.logits.shape
        mask = torch.zeros(shaping.logits.shape, dtype=torch.bool)
        drafts = shaping.draft_id_lists()
        for b, (rid, ids) in enumerate(zip(shaping.request_ids, shaping.token_ids)):
            row = [t for t in drafts[b] if t != PAD]
            for p in range(P):
                banned = self.banned(rid, ids, row[: shaping.first_draft_index + p])
                if banned:
                    mask[b, p, list(banned)] = True
        if mask.any():
            shaping.logits = shaping.logits.masked_fill(mask.to(shaping.logits.device), NEG_INF)


class BadWords(PrefixProcessor):
    """HF's bad_words_ids: a one-token word is always banned; a longer one bans its last token
    wherever the prefix ends with the rest."""

    def __init__(self, cfg, ctx):
        super().__init__(cfg, ctx)
        seqs = [list(s) for s in cfg.token_ids]
        seqs += [ctx.tokenizer.encode(w, add_special_tokens=False) for w in cfg.words]
        self.single = sorted({s[0] for s in seqs if len(s) == 1})
        self.multi = [s for s in seqs if len(s) > 1]

    @hookimpl
    def specflow_process_logits(self, shaping):
        logits = shaping.logits.clone()
        if self.single:
            logits[..., self.single] = NEG_INF
        if self.multi:
            B, P, _ = logits.shape
            drafts = shaping.draft_id_lists()
            for b, ids in enumerate(shaping.token_ids):
                row = [t for t in drafts[b] if t != PAD]
                for p in range(P):
                    seq = ids + row[: shaping.first_draft_index + p]
                    for word in self.multi:
                        if seq[len(seq) - len(word) + 1:] == word[:-1]:
                            logits[b, p, word[-1]] = NEG_INF
        shaping.logits = logits


class _Bias:
    """Adds token biases: the configured ones (`logits=[logit_bias]`) and each request's own
    (`sampling={"logit_bias": {id: bias}}`, the server's `logit_bias` field); a request's
    entries replace the configured ones for the same ids, the other configured ones still apply."""

    key = "logit_bias"

    def __init__(self, cfg, ctx):
        self.cfg = cfg
        V = ctx.target.vocab_size
        bias = {} if cfg is None else cfg.bias
        bad = [t for t in bias if not 0 <= int(t) < V]
        if bad:     # a pipeline checks them first (check_token_ids); a stage built alone, here
            raise ConfigError(f"logits.logit_bias has token ids outside the vocabulary [0, {V}): "
                              f"{bad}")
        self.ids = torch.tensor([int(t) for t in bias], dtype=torch.long)
        self.values = torch.tensor([float(v) for v in bias.values()])

    def keeps_argmax(self, request_ids: list[int], sampling, greedy: bool) -> bool:
        """No bias touches these rows: none configured, none of their requests' own."""
        return not len(self.ids) and not any(row and row.get(self.key) for row in sampling or ())

    def apply(self, shaping) -> None:
        own = shaping.row_values(self.key, None)
        if own is None and not len(self.ids):
            return                          # no configured bias, and no row has its own
        base = shaping.logits
        logits = base.clone()
        if len(self.ids):
            logits[..., self.ids.to(logits.device)] += self.values.to(logits.device)
        for b, row in enumerate(own or ()):
            if row:                         # this request's biases, over the model's own logits
                ids = torch.tensor(list(row), dtype=torch.long, device=logits.device)
                values = torch.tensor(list(row.values()), dtype=logits.dtype,
                                      device=logits.device)
                logits[b, :, ids] = base[b, :, ids] + values
        shaping.logits = logits


class LogitBias(_Bias, PrefixProcessor):
    """`logits=[logit_bias]`: at its place in the processors' order."""

    @hookimpl
    def specflow_process_logits(self, shaping):
        self.apply(shaping)


class RequestLogitBias(_Bias):
    """What the pipeline registers when the config has no logit_bias: requests' own biases only,
    added with the grammar masks, so before every processor (as vLLM adds OpenAI's logit_bias
    before temperature, top-k and top-p); a no-op for rows without one."""

    def __init__(self, ctx):
        super().__init__(None, ctx)

    @hookimpl
    def specflow_mask_logits(self, shaping):
        self.apply(shaping)
