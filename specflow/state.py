"""Dataclasses that travel between stages during one round.

Shapes: B = running sequences this round, K = max draft length this round (ragged rows are padded
with -1), V = vocabulary size, P = positions being shaped (1 for a draft step, K+1 for the target).
Every dataclass has `make_dummy(...)`, which tests use to build valid instances without a model.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from specflow.stages.sampling import position_choice, sample_categorical

if TYPE_CHECKING:
    pass

PAD = -1  # placeholder for a token slot a ragged row does not use


@dataclass
class DecodeBatch:
    """The running batch, as stages see it at the start of a round (rows in slot order)."""

    slots: torch.Tensor                # [B] long: each row's slot in the backends' caches
    request_ids: list[int]             # [B] index of each row's request in generate()'s input
    token_ids: list[list[int]]         # [B][L_b] committed tokens (prompt + generated), live lists
    prompt_lens: list[int]             # [B]
    max_new_tokens: list[int]          # [B] each row's cap on generated tokens (context included)
    generators: list[torch.Generator | None]  # [B] per-request RNG (None under greedy)
    greedy: bool
    max_batch_size: int
    shaper: Callable[..., torch.Tensor] | None = field(repr=False, default=None)  # Pipeline.shape
    # [B] per row, the least chance of acceptance a tree node must have to be proposed this round
    # (specflow_node_price); None = the proposer's configured budget alone decides
    node_price: list[float] | None = None
    # [B] long, each row's request seed when sampling draws are keyed by (seed, position)
    # (verifier.rule=coupled); None: draws come from `generators` (rule=rejection) or greedy
    seeds: torch.Tensor | None = None
    # [B] each row's request's own sampling settings (temperature, top_k, penalties, logit_bias,
    # ...) over the configured ones; None: the config's for every row
    sampling: list[dict | None] | None = None
    # Pipeline.keeps_argmax: (request_ids, sampling, greedy) -> whether shape() leaves these
    # rows' argmax alone; None: assume it does not
    argmax_kept: Callable[..., bool] | None = field(repr=False, default=None)

    def shaping_keeps_argmax(self) -> bool:
        """A greedy round in which shape() leaves every row's argmax as the model's own."""
        return self.greedy and self.argmax_kept is not None and \
            self.argmax_kept(self.request_ids, self.sampling, self.greedy)

    @property
    def draws_by_position(self) -> bool:
        """Sampling whose draws are a function of (seed, position): the verifier commits the
        token plain sampling would, so it matches every child of a node against that one token."""
        return not self.greedy and self.seeds is not None

    def sample(self, probs: torch.Tensor, offset: int) -> torch.Tensor:
        """One draft per row from q [B, V] for the token `offset` places after each row's
        committed tokens, with the draws the verifier will use there -> [B] long."""
        if self.seeds is None:
            return sample_categorical(probs, self.generators)
        positions = torch.tensor([[len(ids) + offset] for ids in self.token_ids],
                                 device=probs.device)                                # [B, 1]
        return position_choice(probs[:, None], self.seeds, positions)[:, 0]

    def shape(self, logits: torch.Tensor, draft_token_ids: torch.Tensor, first_draft_index: int,
              source: str) -> torch.Tensor:
        """Shape logits [B, P, V] of these rows: the one call draft and target share."""
        return self.shaper(logits, self.token_ids, draft_token_ids, first_draft_index,
                           self.request_ids, source, sampling=self.sampling, greedy=self.greedy)

    @property
    def size(self) -> int:
        return len(self.token_ids)

    def select(self, rows: list[int]) -> "DecodeBatch":
        """The same round restricted to some rows (in the given order)."""
        return DecodeBatch(
            slots=self.slots[rows], request_ids=[self.request_ids[b] for b in rows],
            token_ids=[self.token_ids[b] for b in rows],
            prompt_lens=[self.prompt_lens[b] for b in rows],
            max_new_tokens=[self.max_new_tokens[b] for b in rows],
            generators=[self.generators[b] for b in rows], greedy=self.greedy,
            max_batch_size=self.max_batch_size, shaper=self.shaper,
            node_price=None if self.node_price is None else [self.node_price[b] for b in rows],
            seeds=None if self.seeds is None else self.seeds[rows],
            sampling=None if self.sampling is None else [self.sampling[b] for b in rows],
            argmax_kept=self.argmax_kept)

    def num_generated(self, row: int) -> int:
        return len(self.token_ids[row]) - self.prompt_lens[row]

    def last_tokens(self) -> torch.Tensor:
        return torch.tensor([ids[-1] for ids in self.token_ids], dtype=torch.long)  # [B]

    @classmethod
    def make_dummy(cls, batch_size: int = 2, prompt_len: int = 3, vocab_size: int = 8,
                   greedy: bool = True, seed: int = 0) -> "DecodeBatch":
        gen = torch.Generator().manual_seed(seed)
        ids = [torch.randint(0, vocab_size, (prompt_len,), generator=gen).tolist()
               for _ in range(batch_size)]
        gens = [None if greedy else torch.Generator().manual_seed(seed + b) for b in range(batch_size)]
        return cls(slots=torch.arange(batch_size), request_ids=list(range(batch_size)), token_ids=ids,
                   prompt_lens=[prompt_len] * batch_size, max_new_tokens=[16] * batch_size,
                   generators=gens, greedy=greedy,
                   max_batch_size=batch_size, shaper=lambda logits, *_: logits)


@dataclass
class Proposal:
    """What a proposer returns: ragged draft tokens and the distributions they were drawn from."""

    draft_token_ids: torch.Tensor             # [B, K] long, PAD after each row's own k
    draft_probs: torch.Tensor | None = None   # [B, K, V] float, exactly the q each draft was sampled
                                              # from; None = deterministic proposer (one-hot q)
    skip_reasons: list[str | None] | None = None  # [B] why a row asked for drafts got none
                                                  # (e.g. "draft context full"); None: no reason
    parents: torch.Tensor | None = None       # [B, K] long, a tree: each node's parent (-1 = the
                                              # last committed token, else an earlier node);
                                              # None = a chain (node i follows node i - 1)
    catch_up_seconds: float = 0.0             # host time spent caching rows' context before the
                                              # draft steps (a new row's prompt): recorded as the
                                              # round's prefill, not as drafting
    draft_counts: list[int] | None = None     # [B] host: drafts per row, for a chain whose
                                              # proposer knows them without reading the device
                                              # (the k it drafted each row): the round then
                                              # scores the drafts where they are and checks them
                                              # in its one read after verification; None: the
                                              # round reads the drafts to count them
    _host: tuple | None = field(default=None, init=False, repr=False, compare=False)
    # a counted chain's checks, [B] bool on the drafts' device (stages/layout.py), read with
    # the verifier's output, and the drafts as the proposer returned them
    _unchecked: tuple | None = field(default=None, init=False, repr=False, compare=False)
    # how the drafts are laid out (stages/layout.py: ChainLayout or TreeLayout), set when the
    # pipeline checks the proposal; stages read it through stages.layout.layout_of
    layout: Any = field(default=None, repr=False, compare=False)

    @property
    def num_draft_tokens(self) -> torch.Tensor:
        return (self.draft_token_ids != PAD).sum(-1)  # [B]

    def host_draft_token_ids(self) -> torch.Tensor:
        """draft_token_ids on the host [B, K], read from the device once per proposal (the
        round's first host sync; none when the proposer built them on the host)."""
        ids = self.draft_token_ids
        if self._host is None or self._host[0] is not ids:
            self._host = (ids, ids.cpu())
        return self._host[1]

    def host_counts(self) -> list[int]:
        """Drafts (or nodes) per row on the host: the proposer's count, else read from the
        drafts (the host copy the round's check already made)."""
        if self.draft_counts is not None:
            return list(self.draft_counts)
        if not self.draft_token_ids.shape[-1]:           # no drafts at all: nothing to read
            return [0] * self.draft_token_ids.shape[0]
        return (self.host_draft_token_ids() != PAD).sum(-1).tolist()

    def round_drafts(self) -> torch.Tensor:
        """The drafts [B, K] the round's tensor work takes: where the proposer made them when it
        counted them (no host read), else the host copy."""
        if self.draft_counts is not None and self.parents is None:
            return self.draft_token_ids
        return self.host_draft_token_ids()

    def as_chain(self) -> "Proposal":
        """The same drafts as a chain proposal (for a tree whose every row is one path: node i's
        parent is i - 1), keeping the host copy already read."""
        chain = Proposal(self.draft_token_ids, self.draft_probs, self.skip_reasons,
                         catch_up_seconds=self.catch_up_seconds)
        chain._host = self._host
        return chain

    @classmethod
    def for_rows(cls, batch_size: int, rows: list[int], drafts: torch.Tensor,
                 probs: torch.Tensor | None, reasons: list[str | None],
                 parents: torch.Tensor | None = None) -> "Proposal":
        """A whole batch's proposal from the drafts of the rows that drafted (`rows`: their
        indices in the batch; drafts [R, K], q [R, K, V] or None, a tree's parents [R, K] or
        None): PAD and zero q in the other rows, each with its reason in `reasons`."""
        if len(rows) == batch_size:
            return cls(drafts, probs, parents=parents)
        full = cls(drafts.new_full((batch_size, drafts.shape[1]), PAD))   # where drafts are
        full.skip_reasons = reasons
        full.draft_token_ids[rows] = drafts
        if parents is not None:
            full.parents = torch.full_like(full.draft_token_ids, PAD)
            full.parents[rows] = parents
        if probs is not None:
            full.draft_probs = probs.new_zeros(batch_size, *probs.shape[1:])
            full.draft_probs[rows] = probs
        return full

    @classmethod
    def make_dummy(cls, k: list[int], vocab_size: int = 8, with_probs: bool = False,
                   seed: int = 0) -> "Proposal":
        gen = torch.Generator().manual_seed(seed)
        K = max(k, default=0)
        ids = torch.randint(0, vocab_size, (len(k), K), generator=gen)            # [B, K]
        mask = torch.arange(K)[None, :] < torch.tensor(k)[:, None]               # [B, K]
        ids = torch.where(mask, ids, torch.full_like(ids, PAD))
        probs = None
        if with_probs:
            probs = torch.rand(len(k), K, vocab_size, generator=gen).softmax(-1)  # [B, K, V]
        return cls(ids, probs)

    @classmethod
    def empty(cls, batch_size: int, k: int = 0, device=None) -> "Proposal":
        return cls(torch.full((batch_size, k), PAD, dtype=torch.long, device=device))


@dataclass
class ShapingBatch:
    """Logits on their way through `shape()`: grammar masks, then processors, edit `logits`.

    Position p of row b is evaluated on the prefix
        token_ids[b] + draft_token_ids[b, : first_draft_index + p]
    which is exactly the prefix plain decoding would have at that point. A draft step shapes one
    position (P = 1, first_draft_index = i - 1); the verifier shapes K+1 (first_draft_index = 0).
    """

    logits: torch.Tensor             # [B, P, V] float32; hooks replace or edit it in place
    token_ids: list[list[int]]       # [B][L_b] committed tokens of each row
    draft_token_ids: torch.Tensor    # [B, D] long, PAD-padded drafts visible to these positions
    first_draft_index: int           # drafts before position 0
    request_ids: list[int]           # [B]
    source: str                      # "draft" or "target": for observers only; a processor that
                                     # branched on it would break losslessness
    sampling: list[dict | None] | None = None   # [B] a request's own sampling settings
                                     # (temperature, top_k, top_p, min_p, penalties) over the
                                     # configured ones; None: the config's for every row
    greedy: bool = False             # a greedy round: sampling processors leave the logits alone
    _host: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def row_values(self, key: str, default) -> list | None:
        """Each row's value of setting `key` (its request's own, else `default`), or None when
        no row here sets its own (then every row takes `default`)."""
        rows = self.sampling
        if rows is None or all(r is None or key not in r for r in rows):
            return None
        return [default if r is None or key not in r else r[key] for r in rows]

    @property
    def num_positions(self) -> int:
        return self.logits.shape[1]

    def draft_id_lists(self) -> list[list[int]]:
        """draft_token_ids as lists on the host, read once and shared by every stage of this
        call (free for the target's call: the pipeline passes the drafts it already read; one
        device read per draft step when a stage walks the prefix on the host)."""
        if self._host is None or self._host[0] is not self.draft_token_ids:
            self._host = (self.draft_token_ids, self.draft_token_ids.tolist())
        return self._host[1]

    def prefix(self, row: int, position: int) -> list[int]:
        """The tokens position `position` of row `row` is conditioned on (for exact references)."""
        n = self.first_draft_index + position
        drafts = [t for t in self.draft_id_lists()[row][:n] if t != PAD]
        return self.token_ids[row] + drafts

    @classmethod
    def make_dummy(cls, batch_size: int = 2, positions: int = 1, vocab_size: int = 8,
                   source: str = "target", seed: int = 0) -> "ShapingBatch":
        gen = torch.Generator().manual_seed(seed)
        logits = torch.randn(batch_size, positions, vocab_size, generator=gen)   # [B, P, V]
        drafts = torch.randint(0, vocab_size, (batch_size, positions - 1), generator=gen)
        ids = [torch.randint(0, vocab_size, (3,), generator=gen).tolist() for _ in range(batch_size)]
        return cls(logits, ids, drafts, 0, list(range(batch_size)), source)


@dataclass
class VerifyOutput:
    """The verifier's answer for one round."""

    out_token_ids: torch.Tensor  # [B, K+1] long: accepted prefix, recovered or bonus, then PAD
    num_accepted: torch.Tensor   # [B] long: accepted draft tokens (the recovered/bonus not counted)
    accepted_nodes: torch.Tensor | None = None   # [B, K] long, trees only: the accepted path's
                                                 # node indices from the root, PAD after

    @classmethod
    def make_dummy(cls, num_accepted: list[int], k: int, vocab_size: int = 8) -> "VerifyOutput":
        acc = torch.tensor(num_accepted)                                           # [B]
        pos = torch.arange(k + 1)[None, :]                                         # [1, K+1]
        ids = torch.randint(0, vocab_size, (len(num_accepted), k + 1))
        return cls(torch.where(pos <= acc[:, None], ids, torch.full_like(ids, PAD)), acc)


@dataclass
class HiddenStates:
    """Hidden states of a target pass, for the stages that asked for them (specflow_hidden_layers).

    Row b's states sit at cache positions starts[b] .. starts[b] + lens[b] - 1 of slot slots[b]
    (a tree pass: the pass's entries in node order, root first); padding past lens[b] is junk.
    """

    slots: list[int]              # [B]
    starts: list[int]             # [B] cache position of each row's first state
    lens: list[int]               # [B] states per row
    hidden: torch.Tensor          # [B, T, n x E] the layers' input states, concatenated
    layers: tuple[int, ...] = ()  # the layers, in the order they are concatenated

    def select(self, layers: tuple[int, ...]) -> torch.Tensor:
        """[B, T, len(layers) x E]: the given layers' states, in the given order."""
        if tuple(layers) == tuple(self.layers):
            return self.hidden
        E = self.hidden.shape[-1] // len(self.layers)
        parts = self.hidden.split(E, -1)
        return torch.cat([parts[self.layers.index(i)] for i in layers], -1)


@dataclass
class Scores:
    """What specflow_score may return instead of bare logits: the target's logits and, where a
    stage asked for them, the pass's hidden states."""

    logits: torch.Tensor                  # [B, K+1, V] (a tree: [B, N+1, V])
    hidden: list[HiddenStates] = field(default_factory=list)   # the pass's (and a catch-up's)


@dataclass
class RoundResult:
    """What one round did, row by row; handed to policy.observe, metrics and round-end hooks."""

    round_index: int
    request_ids: list[int]        # [B]
    num_drafts: list[int]         # [B] k each row drafted this round
    num_accepted: list[int]       # [B] draft tokens accepted by the verifier
    committed: list[list[int]]    # [B][n_b] tokens committed this round, after stop trimming
    finish_reasons: list[str | None]  # [B] None while the row keeps going
    batch_size: int               # running sequences this round (what load-aware policies read)
    seconds: dict[str, float] = field(default_factory=dict)  # stage -> wall seconds this round
    skip_reasons: list[str | None] = field(default_factory=list)  # [B] why a row ran with k = 0
    sim_time: dict[str, float] = field(default_factory=dict)  # simulated clock units this round
    # trees only (None for chains): each row's accepted node indices from the root, and how
    # many tree levels the verifier examined (the accepted ones, plus the one it rejected at
    # unless the path ended at a leaf)
    accepted_nodes: list[list[int]] | None = None
    num_examined: list[int] | None = None
    tree_depths: list[int] | None = None   # [B] each row's deepest node (num_drafts counts nodes)
    # [B] tokens the round drew up to and including the one that ended the row: the committed
    # ones plus an EOS or a stop string's tokens the trim held back (None: len(committed))
    drawn: list[int] | None = None
    # [B] the draft length each row was asked for (the policy's k, capped by what the row may
    # still commit). A proposer may draft fewer (an n-gram lookup without a match drafts none):
    # the positions it left empty commit nothing, as a rejected draft would. None: num_drafts
    num_asked: list[int] | None = None
    # the round's draft layout (stages/layout.py ChainLayout, stages/tree_round.py RoundTree):
    # what the cache sync asks to keep what the round accepted; None where no round made it
    layout: Any = field(default=None, repr=False, compare=False)

    def path_starts(self, token_ids: list[list[int]]) -> list[int]:
        """[B] after a tree round (token_ids already extended by the commits): where each row's
        tree pass cached its first node, the root's position + 1, which is the committed length
        before this round's tokens. What a stage keeping the accepted path's entries moves to."""
        return [len(ids) - len(new) for ids, new in zip(token_ids, self.committed)]

    def draft_lengths(self) -> list[int]:
        """Per row, the most tokens the drafts could have added: k for a chain, the depth for
        a tree (what a policy's k caps)."""
        return self.tree_depths if self.tree_depths is not None else self.num_drafts

    @classmethod
    def make_dummy(cls, num_drafts: list[int], num_accepted: list[int]) -> "RoundResult":
        B = len(num_drafts)
        return cls(0, list(range(B)), list(num_drafts), list(num_accepted),
                   [[1] * (a + 1) for a in num_accepted], [None] * B, B)


@dataclass
class StepOutput:
    """What Pipeline.step returns for one round: the round's record, the stop trimmer's verdict,
    and the target's shaped distributions (read for logprobs)."""

    round: RoundResult
    trim: object                   # stages.stop.TrimResult: committed tokens, finish reasons
    shaped: torch.Tensor           # [B, P, V] the target's shaped logits of the round
