"""What the pipeline needs from a model: a batched, slot-addressed forward with a rollback-able cache.

A backend holds one cache per batch slot. `forward` appends each row's new tokens to its slot's
cache and returns logits at every new position; `truncate` rolls slots back to a committed length.
Slots are reused as requests come and go (continuous batching); `reset` empties one.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Callable, Hashable

import torch


@dataclass(frozen=True)
class GrammarVocabulary:
    """What grammar constraints need of a tokenizer: the bytes each token spells in generated
    text. `key`: what the spelling depends on (equal keys, the same vocabulary: compiled
    grammars are shared between them); `spell()`: bytes -> the token ids spelling them, EOS and
    special tokens left out (called once per key)."""
    key: Hashable
    spell: Callable[[], dict[bytes, list[int]]]


class Tokenizer:
    """The tokenizer a backend gives (`Backend.tokenizer`): text in and out, EOS, and what it
    declares it can do. A tokenizer that cannot spell its tokens as bytes gives no grammar
    vocabulary, and grammar constraints refuse it in one line."""
    eos_token_id: int | None = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def grammar_vocabulary(self, eos_id: int) -> GrammarVocabulary | None:
        """The tokens' bytes for grammar constraints (EOS `eos_id` apart), or None."""
        return None


def grammar_vocabulary(tokenizer, eos_id: int) -> GrammarVocabulary | None:
    """`tokenizer`'s grammar vocabulary; None for one that declares none (a plugin's tokenizer
    written before the contract had it, which need not subclass Tokenizer)."""
    declared = getattr(type(tokenizer), "grammar_vocabulary", None)
    return declared(tokenizer, eos_id) if declared is not None else None


class SimClock:
    """Simulated time for the synthetic backend: a target step costs 1 unit, a draft step c."""

    def __init__(self) -> None:
        self.time = 0.0
        self.by_source: dict[str, float] = {}

    def charge(self, source: str, units: float) -> None:
        self.time += units
        self.by_source[source] = self.by_source.get(source, 0.0) + units


@dataclass
class TreeAttention:
    """Who attends to whom in a forward over tree nodes. Every query sees the cached keys below
    visible_below[b] (the committed prefix); among the keys from there on it sees those `see`
    marks. Queries sit at their own rotary positions (the prefix length plus their depth), not
    at the cache slots they are written to."""

    positions: torch.Tensor       # [B, T] long, each query's position
    visible_below: list[int]      # [B] keys [0, visible_below[b]) are visible to every query
    see: torch.Tensor             # [B, T, R] bool: query t sees key visible_below[b] + r
    # [B, T] long: each query's parent, as a key index from visible_below[b] (-1 = the last
    # committed position); read by models that feed a node its parent's state (draft heads)
    parent: torch.Tensor | None = None

    def allowed(self, kv_len: int, window: int | None = None) -> torch.Tensor:
        """[B, T, kv_len] bool on `see`'s device: query t may attend key j (the committed
        prefix, only its last `window` positions with a sliding window, and the tree keys `see`
        marks)."""
        B, T, R = self.see.shape
        device = self.see.device
        below = torch.tensor(self.visible_below, device=device)                      # [B]
        keys = torch.arange(kv_len, device=device)                                   # [L]
        rel = keys[None, :] - below[:, None]                                         # [B, L]
        in_tree = (rel >= 0) & (rel < R)                                             # [B, L]
        tree_part = self.see.gather(2, rel.clamp(0, max(R - 1, 0))[:, None, :].expand(B, T, kv_len))
        prefix = (rel < 0)[:, None, :]                                               # [B, 1, L]
        if window is not None:
            prefix = prefix & (keys[None, None, :] > self.positions.to(device)[:, :, None] - window)
        return prefix | (in_tree[:, None, :] & tree_part)                            # [B, T, L]

    @classmethod
    def of_layout(cls, layout, starts: list[int]) -> "TreeAttention":
        """A target tree pass: the root is written at starts[b], node i at starts[b] + 1 + i;
        each sees its ancestors and itself (stages/tree.py TreeLayout)."""
        T = layout.depth.shape[1]
        start = torch.tensor(starts)
        return cls(start[:, None] + layout.depth, list(starts), layout.ancestors()[:, :T, :T])


@dataclass(frozen=True)
class DecoderShape:
    """A decoder's sizes, for what is built to match it (an EAGLE-3 head trained on a target)."""
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int


class Backend(abc.ABC):
    """A causal LM with one rollback-able cache per slot."""

    name: str = "backend"
    vocab_size: int
    eos_token_id: int | None = None
    # every id that ends a sequence (a chat model's end-of-turn among them); empty: eos_token_id
    eos_token_ids: frozenset[int] = frozenset()
    max_length: int | None = None        # context window in tokens, None = unbounded
    # for stages that read hidden states (specflow_hidden_layers): decoder layers (index
    # num_layers is the final normed state) and the width of one layer's state; None: not said
    num_layers: int | None = None
    hidden_size: int | None = None
    supports_rollback: bool = True       # False for recurrent caches: speculation is refused
    device: torch.device = torch.device("cpu")
    tokenizer: Tokenizer
    clock: SimClock | None = None
    # a forward's cost follows rows x its longest input (rows are padded to one length), not the
    # sum of the rows' lengths; the goodput policy prices a round's drafts by it
    pads_rows: bool = True

    @abc.abstractmethod
    def reset(self, slot: int) -> None:
        """Forget everything cached for `slot`."""

    @abc.abstractmethod
    def cache_length(self, slot: int) -> int:
        """Tokens currently cached for `slot`."""

    @abc.abstractmethod
    def forward(self, slots: torch.Tensor, input_ids: torch.Tensor,
                input_lens: torch.Tensor, hidden_layers: tuple[int, ...] = ()):
        """Append input_ids[b, :input_lens[b]] to slot slots[b]'s cache.

        slots [B] long, input_ids [B, T] long (PAD beyond each row's length), input_lens [B] long.
        Returns logits [B, T, V] float32; position t predicts the token after input t.
        With hidden_layers (a backend with `supports_hidden_states`): returns (logits, hidden),
        hidden [B, T, len(hidden_layers) x E] the inputs of those layers (indices below the
        model's layer count) at the same positions, concatenated in ascending layer order. A
        backend without hidden states may leave the argument out of its signature.
        """

    # --- what the backend may choose for itself, and what one pass costs ---------------------

    supports_hidden_states: bool = False   # forward(..., hidden_layers=...) is implemented
    dtype: torch.dtype = torch.float32     # the weights' compute dtype (a head may follow it)

    # --- the weights a draft head shares or copies (None: this backend has none to give) ------

    def input_embeddings(self) -> torch.Tensor | None:
        """[V, E] the token embedding table (an EAGLE-3 head embeds its inputs with it)."""
        return None

    def decoder_shape(self) -> DecoderShape | None:
        """The decoder's sizes (train-head builds a head to match them); None: not said."""
        return None

    def output_head(self) -> torch.Tensor | None:
        """[V, E] the LM head's weight, dense (a head trains from it)."""
        return None

    def final_norm(self) -> torch.Tensor | None:
        """[E] the final RMSNorm's weight (a head starts from it)."""
        return None

    def ends(self) -> frozenset[int]:
        """The ids that end a sequence: `eos_token_ids`, or `eos_token_id` alone (none: empty)."""
        if self.eos_token_ids:
            return frozenset(self.eos_token_ids)
        return frozenset() if self.eos_token_id is None else frozenset([self.eos_token_id])

    def choice_key(self) -> dict | None:
        """What this backend's timed choices depend on (its model's files, dtype, cache and the
        state earlier choices left), as JSON-ready values: their times are kept under it for
        later runs (backends/choice_cache.py). None: keep nothing, time every run."""
        return None

    def tune(self, rows: int, positions: int, settings=None) -> None:
        """Choose what this backend may choose for itself (CPU threads, its weights' layout)
        for the passes a pipeline will run, from one position in one row up to `positions`
        positions in each of `rows` rows, as its own config group says (a backend keeps what it
        was built with: `model.threads`, `model.pack`...). `settings`: the root config, for
        what a backend reads beyond its group. Called once, when the pipeline is built.
        Default: nothing to choose."""
        return None

    def describe(self) -> dict:
        """What metrics.json records about how this backend runs (threads, weight layout,
        kernels); JSON-ready values."""
        return {}

    def time_pass(self, rows: int = 1, positions: int = 1, reps: int = 5,
                  context: int = 32, clock=None) -> float:
        """Median seconds of a pass over `positions` positions in each of `rows` rows (slots
        0..rows-1, each after `context` cached tokens), the device synchronised around each
        pass, read from `clock` (time.perf_counter unless given: backends/choice.py). The slots
        are reset before and after: call it before requests take them."""
        import statistics
        import time

        clock = clock or time.perf_counter

        slots = torch.arange(rows)
        for s in range(rows):
            self.reset(s)
        self.prefill_many(list(range(rows)), [[1] * context] * rows)
        times = []
        for i in range(reps + 2):
            self.truncate(slots, [context] * rows)
            _synchronize(self.device)
            start = clock()
            self.forward(slots, torch.ones(rows, positions, dtype=torch.long),
                         torch.full((rows,), positions))
            _synchronize(self.device)
            if i >= 2:
                times.append(clock() - start)
        for s in range(rows):
            self.reset(s)
        return statistics.median(times)

    def prefill(self, slot: int, ids: list[int]) -> None:
        """Cache a new request's prompt (all but its last token, which the first round feeds)."""
        if ids:
            self.forward(torch.tensor([slot]), torch.tensor([ids]), torch.tensor([len(ids)]))

    def prefill_many(self, slots: list[int], prompts: list[list[int]],
                     hidden_layers: tuple[int, ...] = ()):
        """Cache several new requests' prompts (each without its last token); a backend that can
        batch them overrides this (HFBackend: ragged forwards under a token budget).
        With hidden_layers: -> list[HiddenStates], the prompts' states (one entry per forward
        the backend ran), else None."""
        from specflow.state import HiddenStates

        if not hidden_layers:
            for slot, ids in zip(slots, prompts):
                self.prefill(slot, ids)
            return None
        states = []
        for slot, ids in zip(slots, prompts):
            if ids:
                start = self.cache_length(slot)
                _, hidden = self.forward(torch.tensor([slot]), torch.tensor([ids]),
                                         torch.tensor([len(ids)]), tuple(hidden_layers))
                states.append(HiddenStates([slot], [start], [len(ids)], hidden,
                                           tuple(sorted(hidden_layers))))
        return states

    @abc.abstractmethod
    def truncate(self, slots: torch.Tensor, lengths: list[int]) -> None:
        """Roll each slot's cache back to its first `lengths[b]` tokens."""

    def greedy_steps(self, slots: list[int], fed: list[list[int]], steps: list[int],
                     vocab_size: int, min_confidence: float | None = None
                     ) -> torch.Tensor | None:
        """Optional: greedy draft steps in one call. Row r (cache slot slots[r]) feeds fed[r]
        (the committed tokens its cache lacks, at least one) and then, steps[r] - 1 more times,
        the token its last step found; each step's token is the argmax of the row's last logits'
        first `vocab_size` entries -> [R, max(steps)] long (-1 past a row's steps), the fed
        tokens cached. `min_confidence` (proposer.min_confidence): a row also stops after its
        first token whose probability under the softmax of those logits is below it (that token
        kept). None (this default): the caller steps through forward()."""
        return None

    # --- token trees (optional) -------------------------------------------------------------

    # forward(..., tree=TreeAttention) and keep_cached are implemented: the queries of a forward
    # sit at tree.positions and attend to the cached prefix below tree.visible_below and to the
    # keys tree.see marks (a draft model's tree steps build these; forward_tree below is the
    # target's case)
    supports_trees: bool = False

    def forward_tree(self, slots: torch.Tensor, input_ids: torch.Tensor, input_lens: torch.Tensor,
                     layout, hidden_layers: tuple[int, ...] = ()):
        """Append a tree per row: input_ids [B, N+1] = the row's last committed token, then its
        draft nodes (PAD after input_lens[b]); `layout` (stages/tree.py TreeLayout) gives each
        node's depth and ancestors. Node t sits at position start + depth(t) and attends to the
        cached prefix and to its own ancestors only. The entries are cached in input order
        (keep_cached later keeps the accepted path). Returns logits [B, N+1, V] float32 (and
        the nodes' hidden states with hidden_layers, as forward). This default runs forward
        with the layout's TreeAttention."""
        if not self.supports_trees:
            raise NotImplementedError(f"{type(self).__name__} cannot score token trees")
        starts = [self.cache_length(s) for s in slots.tolist()]
        extra = (tuple(hidden_layers),) if hidden_layers else ()
        return self.forward(slots, input_ids, input_lens, *extra,
                            tree=TreeAttention.of_layout(layout, starts))

    def keep_cached(self, slots: list[int], base: list[int], picks: list[list[int]]) -> None:
        """After a tree pass: for each row, the cached entries base[b] + picks[b][i] move to
        base[b] + i (in order), and the row's length becomes base[b] + len(picks[b])."""
        raise NotImplementedError(f"{type(self).__name__} cannot score token trees")



def _synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a CUDA pass returns before it has run)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
