"""Counters and derived figures (docs/design.md §3), per request and for a whole run.

Formulas, published with the numbers (pitfalls 15 and 24 in docs/design.md):
    acceptance_rate        = accepted / proposed draft tokens                       (vLLM's)
    alpha                  = accepted / examined draft tokens; a draft is examined when every
                             draft before it was accepted (never-examined drafts are not "rejected")
    mean_acceptance_length = drawn tokens / target passes                            (tau)
                             drawn = committed + the token that ended a request where it is not
                             returned (an EOS, a stop string's tokens): plain decoding is 1.0
    c                      = (propose time per draft token) / (target time per pass), measured
    predicted_speedup      = (1 - alpha^(k+1)) / ((1 - alpha)(k c + 1)), k = mean drafts per round
                             that drafted; rounds without drafts (a proposer with nothing to
                             propose, a policy saying k = 0) count as 1 token at cost 1
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from specflow.plugins import hookimpl

STAGES = ("prefill", "policy", "propose", "target", "verify", "trim", "sync")


def expected_tokens(alpha: float, k: float) -> float:
    """Expected tokens committed per target pass with k drafts accepted i.i.d. with probability
    alpha: (1 - alpha^(k+1)) / (1 - alpha), k + 1 at alpha = 1. The one copy of the formula."""
    return k + 1.0 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def predicted_speedup(alpha: float, k: float, c: float, drafting: float = 1.0) -> float:
    """The formula, for a share `drafting` of rounds with k drafts and the rest plain."""
    if k <= 0 or drafting <= 0:
        return 1.0
    tokens = expected_tokens(alpha, k)
    return (drafting * tokens + (1 - drafting)) / (drafting * k * c + 1)


@dataclass
class Counters:
    num_rounds: int = 0
    num_target_passes: int = 0
    num_drafts: int = 0                    # rounds with k > 0
    num_draft_tokens: int = 0              # proposed
    num_examined_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_committed_tokens: int = 0          # after stop trimming: what the user receives
    num_drawn_tokens: int = 0              # committed + the EOS / stop-string tokens that ended
                                           # a request (drawn by a pass, not returned): tau's
    num_tree_drafts: int = 0               # rounds a row drafted a token tree (its
                                           # num_draft_tokens are nodes; per position = per level)
    accepted_per_position: list[int] = field(default_factory=list)
    examined_per_position: list[int] = field(default_factory=list)
    tokens_per_step_histogram: Counter = field(default_factory=Counter)   # committed per round
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    # rounds a row ran without drafts, by reason ("policy", "length cap", "no proposal"):
    # speculation is never switched off silently
    rounds_without_drafts: Counter = field(default_factory=Counter)
    sim_time: dict[str, float] = field(default_factory=dict)   # synthetic backend's clock

    def add_row(self, k: int, accepted: int, committed: int, skip_reason: str | None = None,
                examined: int | None = None, drawn: int | None = None) -> None:
        """One row of one round. k: drafts (a tree's nodes); examined: the tree levels the
        verifier tried (a chain: min(accepted + 1, k)); per-position counts are per depth;
        drawn: tokens the pass drew through the one that ended the row (default committed)."""
        tree = examined is not None
        if examined is None:
            examined = min(accepted + 1, k)
        if k == 0:
            self.rounds_without_drafts[skip_reason or "no proposal"] += 1
        self.num_rounds += 1
        self.num_target_passes += 1
        self.num_drafts += k > 0
        self.num_tree_drafts += tree and k > 0
        self.num_draft_tokens += k
        self.num_examined_draft_tokens += examined
        self.num_accepted_tokens += accepted
        self.num_committed_tokens += committed
        self.num_drawn_tokens += committed if drawn is None else max(drawn, committed)
        self.tokens_per_step_histogram[committed] += 1
        depth = examined if tree else k
        if depth > len(self.examined_per_position):
            grow = depth - len(self.examined_per_position)
            self.examined_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for i in range(examined):
            self.examined_per_position[i] += 1
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    COUNTS = ("num_rounds", "num_target_passes", "num_drafts", "num_draft_tokens",
              "num_examined_draft_tokens", "num_accepted_tokens", "num_committed_tokens",
              "num_tree_drafts", "num_drawn_tokens")

    @classmethod
    def from_dict(cls, d: dict) -> "Counters":
        """Counters back from `as_dict()` (a metrics.json aggregate or a request's stats)."""
        c = cls()
        for key in cls.COUNTS:
            setattr(c, key, int(d.get(key, 0)))
        if "num_drawn_tokens" not in d:      # written before tau counted the ending token
            c.num_drawn_tokens = c.num_committed_tokens
        c.accepted_per_position = list(d.get("accepted_per_position", []))
        c.examined_per_position = list(d.get("examined_per_position", []))
        c.tokens_per_step_histogram = Counter({int(n): v for n, v in
                                               d.get("tokens_per_step_histogram", {}).items()})
        c.rounds_without_drafts = Counter(d.get("rounds_without_drafts", {}))
        c.seconds = {**dict.fromkeys(STAGES, 0.0), **d.get("seconds", {})}
        c.sim_time = dict(d.get("sim_time", {}))
        return c

    def add_counts(self, other: "Counters") -> None:
        """Add another's counts (not its times): merging requests of an earlier session."""
        for key in self.COUNTS:
            setattr(self, key, getattr(self, key) + getattr(other, key))
        for mine, theirs in ((self.accepted_per_position, other.accepted_per_position),
                             (self.examined_per_position, other.examined_per_position)):
            mine += [0] * (len(theirs) - len(mine))
            for i, v in enumerate(theirs):
                mine[i] += v
        self.tokens_per_step_histogram.update(other.tokens_per_step_histogram)
        self.rounds_without_drafts.update(other.rounds_without_drafts)

    def add_seconds(self, seconds: dict[str, float]) -> None:
        for stage, s in seconds.items():
            self.seconds[stage] = self.seconds.get(stage, 0.0) + s

    def derived(self) -> dict:
        proposed, examined = self.num_draft_tokens, self.num_examined_draft_tokens
        alpha = self.num_accepted_tokens / examined if examined else 0.0
        mean_k = proposed / self.num_drafts if self.num_drafts else 0.0
        wall = sum(self.seconds.values())
        c = self.measured_c()
        return {
            "acceptance_rate": self.num_accepted_tokens / proposed if proposed else 0.0,
            "alpha": alpha,
            "mean_acceptance_length": (self.num_drawn_tokens / self.num_target_passes
                                       if self.num_target_passes else 0.0),
            "mean_k": mean_k,
            "acceptance_per_position": [a / e if e else 0.0 for a, e in
                                        zip(self.accepted_per_position, self.examined_per_position)],
            "c": c,
            # the chain formula: meaningless for trees (k would be their nodes)
            "predicted_speedup": (predicted_speedup(alpha, mean_k, c,
                                                    self.num_drafts / self.num_target_passes)
                                  if c is not None and not self.num_tree_drafts else None),
            "wall_seconds": wall,
            "tokens_per_second": self.num_committed_tokens / wall if wall > 0 else 0.0,
        }

    def speculation(self) -> dict:
        """Whether speculation ran ("on", "partly", "off") and, when not always, the main reason:
        it is never switched off without the record saying so."""
        off = sum(self.rounds_without_drafts.values())
        state = "on" if off == 0 else ("off" if off >= self.num_rounds else "partly")
        reason = self.rounds_without_drafts.most_common(1)[0][0] if off else None
        return {"speculation": state, "speculation_off_reason": reason}

    def measured_c(self) -> float | None:
        """Draft cost per token relative to a target pass (simulated time when there is a clock)."""
        if self.sim_time:
            draft, target = self.sim_time.get("draft", 0.0), self.sim_time.get("target", 0.0)
        else:
            draft, target = self.seconds.get("propose", 0.0), self.seconds.get("target", 0.0)
        if not self.num_draft_tokens or not target:
            return None
        return (draft / self.num_draft_tokens) / (target / self.num_target_passes)

    def as_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items()
               if k not in ("tokens_per_step_histogram", "rounds_without_drafts")}
        out["tokens_per_step_histogram"] = {str(n): c for n, c in
                                            sorted(self.tokens_per_step_histogram.items())}
        out["rounds_without_drafts"] = dict(self.rounds_without_drafts)
        out.update(self.speculation())
        out["seconds"] = dict(self.seconds)
        out.update(self.derived())
        return out


class MetricsRecorder:
    """Counts every round per request and for the run; the pipeline owns one per generate()."""

    def __init__(self, clock=None):
        self.clock = clock
        self.total = Counters()
        self.requests: dict[int, Counters] = {}
        self.round_commits: dict[int, list[int]] = {}   # tokens each round committed, per request

    def start(self, request_id: int) -> None:
        self.requests[request_id] = Counters()
        self.round_commits[request_id] = []

    @hookimpl
    def specflow_observe(self, result):
        seconds = result.seconds
        reasons = result.skip_reasons or [None] * len(result.request_ids)
        examined = result.num_examined or [None] * len(result.request_ids)
        drawn = result.drawn or [None] * len(result.request_ids)
        for rid, k, acc, committed, why, seen, n in zip(result.request_ids, result.num_drafts,
                                                        result.num_accepted, result.committed,
                                                        reasons, examined, drawn):
            for counters in (self.requests[rid], self.total):
                counters.add_row(k, acc, len(committed), why, seen, n)
            self.round_commits[rid].append(len(committed))
            self.requests[rid].add_seconds(seconds)
            if result.sim_time:
                _add(self.requests[rid].sim_time, result.sim_time)
        self.total.add_seconds(seconds)
        if result.sim_time:
            _add(self.total.sim_time, result.sim_time)

    def forget(self, request_id: int) -> None:
        """Drop a request's own counters once it has ended (a long-running engine would keep
        every request's otherwise); the totals keep what it added."""
        self.requests.pop(request_id, None)
        self.round_commits.pop(request_id, None)

    def add_prefill(self, request_id: int, seconds: float) -> None:
        for counters in (self.requests[request_id], self.total):
            counters.add_seconds({"prefill": seconds})

    def retract(self, request_id: int, n: int) -> None:
        """A stop string took back n tokens committed in earlier rounds: un-count them, newest first."""
        counters = (self.requests[request_id], self.total)
        commits = self.round_commits[request_id]
        for i in range(len(commits) - 1, -1, -1):
            if n == 0:
                break
            take = min(n, commits[i])
            if take:
                for c in counters:
                    c.tokens_per_step_histogram[commits[i]] -= 1
                    c.tokens_per_step_histogram[commits[i] - take] += 1
                    c.num_committed_tokens -= take
                commits[i] -= take
                n -= take
        for c in counters:
            c.tokens_per_step_histogram += Counter()     # drop buckets that fell to zero


def _add(into: dict[str, float], more: dict[str, float]) -> None:
    for key, value in more.items():
        into[key] = into.get(key, 0.0) + value
