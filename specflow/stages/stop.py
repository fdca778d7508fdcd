"""The stop trimmer: nothing after EOS, a stop token or a stop string is ever committed.

Per row and round, the verifier's chunk (accepted + recovered/bonus) is cut at the earliest of:
the length cap, an EOS or stop token id (excluded), or the end of a stop string, which may start in
an earlier round and end anywhere inside the chunk. A stop that completes within the tokens the cap
allows wins over the cap (finish_reason "stop"/"eos", not "length"). Text, token ids and counts are
cut together, and the text is always the decoding of the kept token ids: the kept tokens are those
wholly before the stop string (with include_stop_str: up to the token that completes it), so when a
token straddles the start of the stop string the text ends at the token boundary before it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from specflow.errors import ConfigError
from specflow.plugins import hookimpl
from specflow.state import PAD


@dataclass
class StopConfig:
    name: str = "default"
    strings: list[str] = field(default_factory=list)   # stop strings (excluded from the output)
    token_ids: list[int] = field(default_factory=list)  # extra stop token ids (excluded)
    eos: bool = True                                     # stop at the model's EOS token
    include_stop_str: bool = False                       # keep the stop string in text and tokens

    def __post_init__(self) -> None:
        for s in self.strings:
            if s == "":
                raise ConfigError("stop.strings contains an empty string, which would stop at once; "
                                  "remove it")


class IncrementalText:
    """Detokenise one token at a time; `ends[i]` is the text length once token i is decoded
    (infinite while token i holds part of a character that has not completed).

    Byte-level tokenisers can split a character over tokens: such a token adds no text until the
    character completes (the approach of vLLM's incremental detokeniser).
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self.ends: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def append(self, token: int) -> None:
        self.ids.append(token)
        self.ends.append(math.inf)            # not settled until its character completes
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix):]
            for j in range(self.read_offset, len(self.ids)):
                self.ends[j] = len(self.text)
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)


@dataclass
class RowStop:
    """What the trimmer keeps for one request."""

    max_new_tokens: int
    strings: list[str]
    stop_ids: frozenset[int]
    text: IncrementalText | None  # only when stop strings are set
    generated: int = 0
    consumed: int = 0             # last round: chunk tokens sampled up to and including the end


@dataclass
class TrimResult:
    committed: list[list[int]]          # [B][n_b] tokens to commit this round
    finish_reasons: list[str | None]    # [B] "stop" | "eos" | "length" | None
    retract: list[int] = field(default_factory=list)  # [B] earlier-committed tokens to take back:
                                        # a stop string that began in a previous round
    consumed: list[int] | None = None   # [B] chunk tokens plain decoding would have sampled this
                                        # round: up to and including the one that ended the row


class StopTrimmer:
    def __init__(self, cfg: StopConfig, ctx):
        self.cfg = cfg
        self.tokenizer = ctx.tokenizer
        target = ctx.target
        self.eos_ids = target.ends() if cfg.eos else frozenset()   # every EOS the model declares
        self.rows: dict[int, RowStop] = {}

    @hookimpl
    def specflow_request_start(self, slot, request):
        strings = list(self.cfg.strings if request.stop is None else request.stop)
        stop_ids = set(self.cfg.token_ids) | self.eos_ids
        self.rows[request.request_id] = RowStop(
            request.max_new_tokens, strings, frozenset(stop_ids),
            IncrementalText(self.tokenizer) if strings else None)

    @hookimpl
    def specflow_request_end(self, slot, request, finish_reason):
        self.rows.pop(request.request_id, None)

    @hookimpl
    def specflow_trim(self, batch, verified):
        chunks = verified.out_token_ids.tolist()   # the round's one host sync: stop checks need ids
        result = TrimResult([], [], [], [])
        for rid, chunk in zip(batch.request_ids, chunks):
            tokens, reason, retract = self.trim_row(self.rows[rid], [t for t in chunk if t != PAD])
            result.committed.append(tokens)
            result.finish_reasons.append(reason)
            result.retract.append(retract)
            result.consumed.append(self.rows[rid].consumed)
        return result

    def trim_row(self, row: RowStop, chunk: list[int]):
        """-> (tokens to commit, finish_reason, earlier-committed tokens to take back)"""
        allowed = row.max_new_tokens - row.generated
        capped = chunk[:allowed]
        row.consumed = len(capped)
        # earliest stop token id (completes at its own index)
        cut, reason = len(capped), None
        for i, t in enumerate(capped):
            if t in row.stop_ids:
                cut, reason = i, ("eos" if t in self.eos_ids else "stop")
                row.consumed = i + 1
                break
        keep, retract = capped[:cut], 0
        if row.text is not None:
            keep, reason, retract = self._stop_strings(row, keep, reason)
        if reason is None and row.generated + len(keep) >= row.max_new_tokens:
            reason = "length"
        row.generated += len(keep) - retract
        return keep, reason, retract

    def _stop_strings(self, row: RowStop, tokens: list[int], reason: str | None):
        """Feed tokens to the row's text; cut at the first stop string that completes in them."""
        inc = row.text
        base = len(inc.ids)
        search_from = max(0, len(inc.text) - max(len(s) for s in row.strings) + 1)
        for i, t in enumerate(tokens):
            inc.append(t)
            hit = _find_first(inc.text, row.strings, search_from)
            if hit is None:
                continue
            start, _ = hit
            row.consumed = i + 1
            if self.cfg.include_stop_str:
                return tokens[:i + 1], "stop", 0
            # keep the tokens whose text ends at or before the stop string's start; the string
            # may have begun in tokens committed in an earlier round: take those back
            n_keep = sum(1 for e in inc.ends[: base + i + 1] if e <= start)
            return tokens[:max(0, n_keep - base)], "stop", max(0, base - n_keep)
        return tokens, reason, 0


def _find_first(text: str, strings: list[str], start: int) -> tuple[int, int] | None:
    best = None
    for s in strings:
        pos = text.find(s, start)
        if pos >= 0 and (best is None or pos < best[0]):
            best = (pos, pos + len(s))
    return best
