"""A table-driven language model with a simulated clock (article B's simulator, context-dependent).

The target's next-token distribution depends on the last two tokens: a fixed hash maps them to one
of `contexts` rows, and row c is a fixed base distribution (Dirichlet(concentration) over V, as in
the seed) under its own permutation of the vocabulary. The draft is the target interpolated toward
uniform, q = (1 - noise) p + noise / V (the seed's `draft_noise`).

Because every row is a permutation of one base distribution and the uniform part is permutation
invariant, the acceptance probability sum_x min(p(x), q(x)) is the same in every context: draft
acceptance is exactly i.i.d. per position, which is the assumption behind the formula
(1 - a^(k+1)) / (1 - a). `acceptance_for_noise` computes it and `noise_for_acceptance` inverts it.

Cost model (SimClock): a forward call of the target costs `step_cost + token_cost * tokens`, a draft
call `step_cost` (the measured c of a real pair goes here).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from specflow.config import check_backend_settings
from specflow.errors import ConfigError, InputError
from specflow.backends.contract import Backend, SimClock, Tokenizer, TreeAttention

# the first vocab_size characters are the synthetic vocabulary (64 covers "def fib(n):" and prose)
ALPHABET = ("\n abcdefghijklmnopqrstuvwxyz0123456789():.,=_+-*/'\"[]#<>!?"
            "ABCDEFGHIJKLMNOPQRSTUVWXYZ{}%&|;@$^`~\\\t")


class CharTokenizer(Tokenizer):
    """One character per token; the synthetic model's text is readable enough to test stop
    strings. It gives no grammar vocabulary (grammar constraints refuse it)."""

    def __init__(self, vocab_size: int, eos_token_id: int | None = None):
        if vocab_size > len(ALPHABET):
            raise ConfigError(f"model.vocab_size={vocab_size} is larger than the synthetic alphabet "
                              f"({len(ALPHABET)}); use at most {len(ALPHABET)}")
        self.chars = ALPHABET[:vocab_size]
        self.index = {c: i for i, c in enumerate(self.chars)}
        self.eos_token_id = eos_token_id
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        unknown = sorted({c for c in text if c not in self.index})
        if unknown:
            raise InputError(f"prompt has characters the synthetic model's {self.vocab_size}-token "
                             f"alphabet lacks: {''.join(unknown)!r}; use only {self.chars!r}")
        return [self.index[c] for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids if i != self.eos_token_id)


@dataclass
class SyntheticModelConfig:
    name: str = "synthetic"
    vocab_size: int = 64           # the seed's simulator
    contexts: int = 256            # distinct next-token distributions (the seed: 256 rows)
    concentration: float = 0.5     # Dirichlet concentration of the base distribution (the seed's)
    seed: int = 0                  # the tables; same seed in target and draft
    step_cost: float = 1.0         # simulated time of one target forward call
    token_cost: float = 0.0        # extra simulated time per token in a call (0: memory bound)
    max_length: int = 1_000_000    # context window
    eos_token_id: int | None = None
    threads: Any = "auto"          # the target's CPU threads (the root `threads` fills it)

    def __post_init__(self) -> None:
        if not 2 <= self.vocab_size <= len(ALPHABET):
            raise ConfigError(f"model.vocab_size={self.vocab_size} must be in [2, {len(ALPHABET)}]")
        if self.contexts < 1:
            raise ConfigError(f"model.contexts={self.contexts} must be >= 1")
        if self.concentration <= 0:
            raise ConfigError(f"model.concentration={self.concentration} must be > 0")
        if self.step_cost < 0 or self.token_cost < 0:
            raise ConfigError("model.step_cost and model.token_cost must be >= 0")
        if not 0 <= self.seed < 2 ** 32:
            raise ConfigError(f"model.seed={self.seed} must be in [0, 2^32) (numpy's seed range)")
        if self.max_length < 2:
            raise ConfigError(f"model.max_length={self.max_length} must be >= 2")
        check_backend_settings(threads=self.threads)
        if self.eos_token_id is not None and not 0 <= self.eos_token_id < self.vocab_size:
            raise ConfigError(f"model.eos_token_id={self.eos_token_id} is outside the vocabulary "
                              f"[0, {self.vocab_size}); use null for no EOS")


@dataclass
class SyntheticDraftConfig(SyntheticModelConfig):
    name: str = "synthetic"
    noise: float = 0.3             # 0: the draft is the target; 1: uniform
    mismatch: float = 0.0          # fraction of contexts where the draft ranks tokens differently
                                   # (greedy acceptance < 1; breaks the i.i.d. acceptance property)
    step_cost: float = 0.1         # c: one draft step relative to one target step
    noise_by_prefix: dict[str, float] | None = None  # per-request draft noise by
                                   # prompt prefix: {"code": 0.05, "chat": 0.9} mixes traffic

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.noise <= 1.0:
            raise ConfigError(f"draft.noise={self.noise} must be in [0, 1] (0 = same as target)")
        if not 0.0 <= self.mismatch <= 1.0:
            raise ConfigError(f"draft.mismatch={self.mismatch} must be in [0, 1]")
        for prefix, noise in (self.noise_by_prefix or {}).items():
            if not 0.0 <= noise <= 1.0:
                raise ConfigError(f"draft.noise_by_prefix[{prefix!r}]={noise} must be in [0, 1]")


def base_distribution(vocab_size: int, concentration: float, seed: int) -> torch.Tensor:
    """The Dirichlet(concentration) distribution every context permutes (as the seed draws its rows)."""
    p = np.random.default_rng(seed).dirichlet(np.full(vocab_size, concentration))
    p = np.maximum(p, 1e-12)                       # no exact zeros: every token stays reachable
    return torch.from_numpy(p / p.sum())           # [V] float64


def acceptance_for_noise(base: torch.Tensor, noise: float) -> float:
    """sum_x min(p, q) for q = (1 - noise) p + noise / V: the per-position acceptance probability."""
    q = (1 - noise) * base + noise / base.numel()
    return float(torch.minimum(base, q).sum())


def noise_for_acceptance(base: torch.Tensor, alpha: float) -> float:
    """The draft noise whose acceptance probability is `alpha` (bisection; acceptance falls with noise)."""
    floor = acceptance_for_noise(base, 1.0)
    if not floor <= alpha <= 1.0:
        raise ConfigError(f"acceptance {alpha} is not reachable by this synthetic pair "
                          f"(range [{floor:.3f}, 1]); pick a value in it")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if acceptance_for_noise(base, mid) > alpha:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


class SyntheticBackend(Backend):
    """Target (noise 0) or draft (noise > 0) over the same context-dependent tables."""

    name = "synthetic"
    pads_rows = False          # the simulated clock charges each row's own tokens

    def __init__(self, cfg: SyntheticModelConfig, noise: float = 0.0, clock: SimClock | None = None,
                 source: str = "target", slots: int = 1, mismatch: float = 0.0):
        self.cfg = cfg
        self.vocab_size = V = cfg.vocab_size
        self.eos_token_id = cfg.eos_token_id
        self.max_length = cfg.max_length
        self.threads = cfg.threads
        self.noise = noise
        self.clock = clock
        self.source = source
        self.tokenizer = CharTokenizer(V, cfg.eos_token_id)
        gen = torch.Generator().manual_seed(cfg.seed)
        self.base = base_distribution(V, cfg.concentration, cfg.seed)                      # [V]
        perms = torch.stack([torch.randperm(V, generator=gen) for _ in range(cfg.contexts)])  # [C, V]
        # context of a position = hash of (previous token, current token); row V stands for "none"
        self.context_of = torch.randint(0, cfg.contexts, (V + 1, V), generator=gen)          # [V+1, V]
        if mismatch > 0:   # drawn after the shared tables, so the target is the same either way
            mgen = torch.Generator().manual_seed(cfg.seed + 1)
            flip = torch.rand(cfg.contexts, generator=mgen) < mismatch                        # [C]
            other = torch.stack([torch.randperm(V, generator=mgen) for _ in range(cfg.contexts)])
            perms = torch.where(flip[:, None], other, perms)
        self.probs = self.base[perms].float()                                                 # [C, V]
        q = (1 - noise) * self.probs + noise / V
        self.log_table = q.log()                                                              # [C, V]
        self.noise_by_prefix = dict(getattr(cfg, "noise_by_prefix", {}) or {})
        self.slot_noise: dict[int, float] = {}       # slots whose request has its own noise
        self.history = torch.full((slots, 64), -1, dtype=torch.long)                          # [S, cap]
        self.lengths = [0] * slots

    def _ensure(self, slot: int, length: int) -> None:
        S, cap = self.history.shape
        if slot >= S or length > cap:
            new = torch.full((max(S, slot + 1), max(cap, 2 * length)), -1, dtype=torch.long)
            new[:S, :cap] = self.history
            self.history = new
            self.lengths += [0] * (new.shape[0] - S)

    def reset(self, slot: int) -> None:
        self._ensure(slot, 1)
        self.lengths[slot] = 0

    def cache_length(self, slot: int) -> int:
        return self.lengths[slot]

    def tune(self, rows: int, positions: int, settings=None) -> None:
        """Nothing to time (the simulated clock prices its passes); a number of `threads`
        (model.threads) is applied all the same, as for any CPU run (the tables' lookups are
        torch ops)."""
        threads = self.threads
        if self.source == "target" and threads != "auto":
            torch.set_num_threads(int(threads))

    def describe(self) -> dict:
        return {"forward": "synthetic", "threads": torch.get_num_threads(), "packed": False,
                "kernels": None}

    def time_pass(self, rows: int = 1, positions: int = 1, reps: int = 5,
                  context: int = 32, clock=None) -> float:
        """Wall seconds of the table lookups (not what the clock charges: its passes are
        simulated); the clock is left as it was."""
        simulated, self.clock = self.clock, None
        try:
            return super().time_pass(rows, positions, reps, context, clock)
        finally:
            self.clock = simulated

    def forward(self, slots: torch.Tensor, input_ids: torch.Tensor,
                input_lens: torch.Tensor, tree=None) -> torch.Tensor:
        B, T = input_ids.shape
        slot_list, lens = slots.tolist(), input_lens.tolist()
        for s, n in zip(slot_list, lens):
            self._ensure(s, self.lengths[s] + n)
        starts = torch.tensor([self.lengths[s] for s in slot_list], dtype=torch.long)       # [B]
        last = self.history[slots, (starts - 1).clamp(min=0)]                              # [B]
        prev_token = torch.where(starts > 0, last, torch.full_like(last, self.vocab_size))  # [B]
        ids = input_ids.clamp(min=0)                                                        # [B, T]
        prev = torch.cat([prev_token[:, None], ids[:, :-1]], 1)                            # [B, T]
        if tree is not None:     # each query's previous token: its deepest visible tree entry
            prev = self._tree_prev(slot_list, starts, ids, tree)
        ctx = self.context_of[prev, ids]                                                    # [B, T]
        noise = [self.slot_noise.get(s) for s in slot_list]
        if all(n is None for n in noise):
            logits = self.log_table[ctx]                                                    # [B, T, V]
        else:
            n = torch.tensor([self.noise if x is None else x for x in noise])[:, None, None]
            logits = ((1 - n) * self.probs[ctx] + n / self.vocab_size).log()               # [B, T, V]
        positions = starts[:, None] + torch.arange(T)[None, :]                             # [B, T]
        mask = torch.arange(T)[None, :] < input_lens[:, None]                              # [B, T]
        rows = slots[:, None].expand(B, T)
        self.history[rows[mask], positions[mask]] = input_ids[mask]
        for s, n in zip(slot_list, lens):
            self.lengths[s] += n
        if self.clock is not None:
            cost = self.cfg.step_cost + self.cfg.token_cost * sum(lens)
            self.clock.charge(self.source, cost)
        return logits

    supports_trees = True

    def _tree_prev(self, slots: list[int], starts: torch.Tensor, ids: torch.Tensor,
                   tree) -> torch.Tensor:
        """[B, T] the token before each tree query: the latest entry it sees other than itself
        (ancestors are written before their children), else the last committed token."""
        B, T = ids.shape
        R = tree.see.shape[2]
        below = torch.tensor(tree.visible_below)                                          # [B]
        first = starts - below                       # [B] where this input's entries start
        own = first[:, None] + torch.arange(T)[None, :]                                  # [B, T]
        seen = tree.see & (torch.arange(R)[None, None, :] != own[:, :, None])           # [B, T, R]
        r = torch.where(seen, torch.arange(R), -1).max(-1).values                        # [B, T]
        rows = torch.tensor(slots)[:, None].expand(B, T)
        cached = self.history[rows, (below[:, None] + r).clamp(min=0)]                   # [B, T]
        fresh = ids.gather(1, (r - first[:, None]).clamp(0, T - 1))     # not in the history yet
        last = self.history[rows[:, 0], (below - 1).clamp(min=0)]
        root = torch.where(below > 0, last, torch.full_like(last, self.vocab_size))      # [B]
        return torch.where(r < 0, root[:, None],
                           torch.where(r >= first[:, None], fresh, cached))

    def forward_tree(self, slots: torch.Tensor, input_ids: torch.Tensor, input_lens: torch.Tensor,
                     layout) -> torch.Tensor:
        """A position's context is (its parent's token, its token): forward() with the tree's
        attention, whose deepest visible entry is each node's parent."""
        starts = [self.lengths[s] for s in slots.tolist()]
        return self.forward(slots, input_ids, input_lens,
                            tree=TreeAttention.of_layout(layout, starts))

    def keep_cached(self, slots: list[int], base: list[int], picks: list[list[int]]) -> None:
        for s, b, pick in zip(slots, base, picks):
            if pick:
                self.history[s, b:b + len(pick)] = self.history[s, torch.tensor(pick) + b]
            self.lengths[s] = b + len(pick)

    def noise_of(self, slot: int) -> float:
        return self.slot_noise.get(slot, self.noise)

    def prefill(self, slot: int, ids: list[int]) -> None:
        self.slot_noise.pop(slot, None)
        if self.noise_by_prefix:
            text = self.tokenizer.decode(ids)
            for prefix, noise in (self.noise_by_prefix or {}).items():
                if text.startswith(prefix):
                    self.slot_noise[slot] = noise
                    break
        clock, self.clock = self.clock, None     # the clock counts decode rounds only
        try:
            super().prefill(slot, ids)
        finally:
            self.clock = clock

    def truncate(self, slots: torch.Tensor, lengths: list[int]) -> None:
        for s, n in zip(slots.tolist(), lengths):
            self.lengths[s] = min(self.lengths[s], n)

    def tokens(self, slot: int) -> list[int]:
        """The cached tokens of a slot (tests compare them with the committed sequence)."""
        return self.history[slot, : self.lengths[slot]].tolist()
