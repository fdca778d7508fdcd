"""Every hook specflow calls: the only contract between the pipeline and its stages.

Stage hooks are called by a pipeline through its own PluginManager (two pipelines never share
state); discovery hooks are called once on the global manager; lifecycle hooks let observers (a
tracing plugin, a metrics exporter) follow a pipeline. Shapes use docs/design.md's letters: B running
rows, K max draft length this round, V vocabulary, P positions being shaped.

Hook API version: see `HOOK_API_VERSION`. Adding a hook or an optional keyword is a minor change;
renaming or removing one, or changing what a hook returns, is a major one.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import torch

    from specflow.pipeline import Pipeline, Request
    from specflow.plugins import Registry
    from specflow.state import DecodeBatch, HiddenStates, Proposal, RoundResult, ShapingBatch, \
        VerifyOutput
    from specflow.stages.stop import TrimResult

HOOK_API_VERSION = "1.5"   # 1.1: run_start / run_end; 1.2: request_end "abort", masks first;
                           # 1.3: prefill (the prompts admitted together, in one call);
                           # 1.4: node_price (what a tree node must be worth to be scored);
                           # 1.5: hidden_layers / target_states (the target's hidden states as
                           # data), draft_step_seconds / catch_up_tokens (a proposer's costs)

hookspec = pluggy.HookspecMarker("specflow")


# ---------------------------------------------------------------------------------------------
# discovery hooks: called on the global plugin manager
# ---------------------------------------------------------------------------------------------

@hookspec
def specflow_config_searchpath() -> str | list[str] | None:
    """Called once when Hydra builds its config search path (any specflow command or compose).

    Return one search path entry or a list of them, e.g. ``"pkg://specflow_suffix.conf"``, whose
    group folders (``proposer/``, ``logits/``, ...) add options next to the built-in ones.
    All results are used.
    """


@hookspec
def specflow_register(registry: "Registry") -> None:
    """Called once when the global plugin manager is built, to name components.

    Call ``registry.add(kind, name, factory, schema=...)`` for each component the plugin provides:
    kind is a config group (``proposer``, ``logits``, ``constraint``, ``policy``, ``verifier``,
    ``stop``, ``model``, ``draft``, ``observer``), name is the value of ``name:`` in the option's yaml,
    factory(cfg, ctx) builds a stage object whose ``@hookimpl`` methods the pipeline registers, and
    schema is the dataclass that validates the option. Returns nothing; all implementations run.
    """


# ---------------------------------------------------------------------------------------------
# stage hooks: called by a pipeline through its own plugin manager, once per round unless noted
# ---------------------------------------------------------------------------------------------

@hookspec(firstresult=True)
def specflow_draft_length(batch: "DecodeBatch") -> "torch.Tensor | None":
    """Called first in every round: the policy chooses the draft length of each row.

    Return a LongTensor [B] of k >= 0 (0 = plain decoding for that row this round). The first
    non-None result wins. The pipeline then caps k by the tokens and context each row has left.
    """


@hookspec(firstresult=True)
def specflow_node_price(batch: "DecodeBatch", k: "torch.Tensor") -> "torch.Tensor | None":
    """Called after the policy, before the proposer, with the capped k [B]: the least chance of
    acceptance a draft node must have for scoring it to pay this round.

    Return a float tensor [B] of prices in [0, 1] (0 = every node the proposer's budget allows), or
    None to leave tree sizes to the proposer's configured budget. The pipeline puts it on
    ``batch.node_price``; a tree proposer that can estimate each node's chance of acceptance (the
    built-in draft model does) proposes only nodes worth at least the price, within its budget.
    At a price of 1 no branch can pay, so the built-in tree proposers draft a plain chain.
    The built-in goodput policy prices a node at the throughput it displaces: tokens per second
    times the measured cost of one more scored position. The first non-None result wins.
    """


@hookspec(firstresult=True)
def specflow_propose(batch: "DecodeBatch", k: "torch.Tensor") -> "Proposal | None":
    """Called once per round after the policy, with k [B] (some rows may have k = 0).

    Return a Proposal: draft_token_ids [B, max(k)] padded with -1, and draft_probs [B, max(k), V]
    holding exactly the distributions the drafts were sampled from (None for a deterministic
    proposer). A row may return fewer drafts than asked. A token tree (``proposer.topk`` > 1) holds
    N nodes per row instead (draft_token_ids [B, N], draft_probs [B, N, V], siblings sharing their
    parent's q) and sets ``parents`` [B, N]: -1 for a child of the root, else the index of an
    earlier node; k is then each row's depth. A model proposer shapes its logits with
    ``batch.shape(...)`` so processors and constraints apply as they do to the target.
    A chain proposer that drafts on a device and knows how many drafts each row holds (its k)
    sets ``draft_counts`` (a host list [B]): the round then scores the drafts where they are and
    checks them on the device, and reads the device once, after verification; without it the
    drafts are read to the host to be counted.
    The first non-None result wins.
    """


@hookspec(firstresult=True)
def specflow_score(batch: "DecodeBatch", proposal: "Proposal") -> "torch.Tensor | None":
    """Called once per round after the proposer: the target's forward pass over each row's last
    committed token followed by its drafts.

    A chain (``proposal.parents`` is None): return raw target logits [B, K+1, V], position j
    predicting the token after draft j. The built-in implementation runs the configured target
    model and extends its KV cache by k_b + 1 entries; specflow_sync_cache rolls back what was not
    committed.

    A token tree (``proposal.parents`` [B, N]: -1 for a child of the root, the row's last committed
    token, else the index of an earlier node): return [B, N+1, V], position 0 after the committed
    prefix and position i + 1 after node i's root path. Each node sits at the position of its
    depth and attends to the committed prefix and its own ancestors only (the built-in scorer calls
    the backend's ``forward_tree``; the entries are cached in node order, and after verification
    only the accepted path is kept, moved into place). A tree whose every row is one path reaches
    this hook as a chain. The first non-None result wins.
    """


@hookspec
def specflow_process_logits(shaping: "ShapingBatch") -> None:
    """Called by shape() for every draft step and for the target's K+1 positions, after the masks.

    Edit ``shaping.logits`` [B, P, V] (replace or modify in place); position p of row b must be
    evaluated on ``shaping.prefix(b, p)``. Implementations run in config order (the pipeline
    registers them so); all run. Returns nothing.
    """


@hookspec
def specflow_mask_logits(shaping: "ShapingBatch") -> None:
    """Called by shape() before the logit processors: grammar constraints set forbidden tokens to -inf.

    Same contract as specflow_process_logits; a constraint advances its state only tentatively over
    drafts (committed state changes in specflow_sync_cache). Masks run first (as in vLLM and
    outlines), so top-k / top-p / min-p then truncate among the allowed tokens. Returns nothing;
    all run.
    """


@hookspec(firstresult=True)
def specflow_verify(batch: "DecodeBatch", proposal: "Proposal",
                    target_probs: "torch.Tensor") -> "VerifyOutput | None":
    """Called once per round after the target pass, with target_probs [B, K+1, V] (shaped).

    A chain: return a VerifyOutput with out_token_ids [B, K+1] (accepted prefix, recovered or
    bonus, -1 padding) and num_accepted [B].

    A token tree (``proposal.parents`` set): target_probs is [B, N+1, V], position 0 after the
    committed prefix and i + 1 after node i, each node shaped on its own root path. Accept one
    root-to-node path per row and return out_token_ids [B, N+1] (the path's tokens, then the
    recovered or bonus token, then -1), num_accepted [B] (the path's length) and accepted_nodes
    [B, N] (the path's node indices from the root, -1 after), which cache sync uses to keep the
    path's entries. ``specflow.verify_tree`` does this exactly (longest greedy path, or multi-draft
    rejection sampling). The first non-None result wins.
    """


@hookspec(firstresult=True)
def specflow_trim(batch: "DecodeBatch", verified: "VerifyOutput") -> "TrimResult | None":
    """Called once per round after verification: EOS, stop strings and the length cap.

    Return a TrimResult: for each row the tokens to commit (nothing after a stop) and its
    finish_reason ("stop", "eos", "length" or None to go on). The first non-None result wins.
    """


@hookspec
def specflow_sync_cache(batch: "DecodeBatch", result: "RoundResult") -> None:
    """Called after trimming, once the round's committed tokens are appended to ``batch.token_ids``.

    Every stage with per-sequence state (target and draft KV, n-gram index, grammar and penalty
    state) brings it to the committed length of each row. Returns nothing; all run.
    """


@hookspec
def specflow_observe(result: "RoundResult") -> None:
    """Called at the end of every round with what it did (k, accepted, committed per row).

    Policies learn acceptance and cost here; metrics count. Returns nothing; all run.
    """


@hookspec
def specflow_hidden_layers() -> "list[int] | None":
    """Called when the pipeline is built (and when `Pipeline.register` adds a plugin that
    answers it): the target layers whose hidden states a stage reads (an EAGLE-3 head's three,
    an MTP or Medusa head's last one).

    Return layer indices (the state at the input of each layer; ``num_layers`` for the final
    normed state, transformers' last ``hidden_states`` entry), or None; an index outside
    0..num_layers is a ConfigError. The pipeline asks the target for the union of all answers
    at every pass it runs (``Backend.forward(..., hidden_layers=...)``) and hands them out
    through specflow_target_states. All results are used.
    """


@hookspec
def specflow_target_states(states: "HiddenStates") -> None:
    """Called after every target pass that computed the layers specflow_hidden_layers asked for:
    a prompt's prefill, a catch-up, and each round's scoring pass (after specflow_score, before
    shaping and verification).

    ``states.hidden`` [B, T, n x E] holds row b's states for cache positions ``states.starts[b]``
    to ``starts[b] + lens[b]`` of slot ``states.slots[b]``, the layers concatenated in the order
    ``states.layers`` gives. After a tree pass the positions are the pass's node order (root
    first); specflow_sync_cache's ``result.accepted_nodes`` says which path the round kept.
    Returns nothing; all run.
    """


@hookspec(firstresult=True)
def specflow_draft_step_seconds(rows: int, positions: int) -> "float | None":
    """Called by a policy that prices drafting (the goodput policy, once, after the pipeline is
    built): the seconds one draft step costs over ``positions`` positions in each of ``rows``
    rows, timed now on the proposer's own device (synchronised), its caches left as they were.

    A proposer that runs a model (a draft model, a draft head) answers; a proposer whose drafts
    cost next to nothing (n-gram lookup) returns None. The first non-None result wins.
    """


@hookspec(firstresult=True)
def specflow_catch_up_tokens(batch: "DecodeBatch") -> "list[int] | None":
    """Called by a policy that prices drafting, before it chooses k: for each row, the tokens
    the proposer would have to feed its own model before its first draft step this round beyond
    those a step takes for free (a draft model whose cache lags after rounds without drafts).

    Return one int per row (0 = nothing beyond the steps), or None (no such cost). The policy
    prices each token at a draft position's measured cost. The first non-None result wins.
    """


# ---------------------------------------------------------------------------------------------
# lifecycle hooks: called by a pipeline through its own plugin manager
# ---------------------------------------------------------------------------------------------

@hookspec
def specflow_pipeline_built(pipeline: "Pipeline") -> None:
    """Called once, after a pipeline has registered all its stages. Returns nothing."""


@hookspec
def specflow_run_start(pipeline: "Pipeline", requests: "list[Request]") -> None:
    """Called at the start of every ``Pipeline.generate`` call, before any request takes a slot.

    ``requests`` are all the requests of the call, in prompt order. Observers open a trace here;
    a proposer with a store outside the process (a suffix cache file) may reload it.
    Returns nothing; all run.
    """


@hookspec
def specflow_run_end(pipeline: "Pipeline", results: list, stats: dict) -> None:
    """Called once a ``Pipeline.generate`` call has finished every request (not after an error).

    ``results`` are the GenerationResults in prompt order and ``stats`` the aggregate metrics
    (docs/design.md §3 names). Observers write their files here (a Chrome trace, a table);
    stages with state worth keeping across runs save it. Returns nothing; all run.
    """


@hookspec
def specflow_request_start(slot: int, request: "Request") -> None:
    """Called when a request takes a batch slot (before its first round; slots are reused).

    ``request`` has request_id, prompt, prompt_ids, max_new_tokens, stop and seed. Per-request
    state is keyed one way: by ``request.request_id`` (the request's index in its generate()
    call, so ids repeat across calls), or by ``slot`` for what lives in a batch slot (cache
    rows). A stage with such state (re)sets it here, never trusting what an earlier call left.
    Returns nothing; all run.
    """


@hookspec
def specflow_prefill(slots: list[int], requests: "list[Request]") -> None:
    """Called once per admission, after specflow_request_start of every request admitted
    together (the requests that take free slots before the same round), in admission order.

    A stage that caches a prompt in a model (the target's cache, a draft model's) does it here,
    for all of them in one batched forward, rather than one forward per request in
    request_start. Each request's last prompt token is left out: the first round feeds it.
    Returns nothing; all run.
    """


@hookspec
def specflow_request_end(slot: int, request: "Request", finish_reason: str) -> None:
    """Called when a request leaves its slot, on every exit path: ``finish_reason`` is "stop",
    "eos" or "length" when it finished, and "abort" for every request still running when
    generate() ends early (an error, a plugin raising, Ctrl-C). Release per-request state here.
    Returns nothing; all run.
    """


@hookspec
def specflow_round_end(result: "RoundResult", pipeline: "Pipeline") -> Any:
    """Called after every round, after specflow_observe. A ``wrapper=True`` implementation of any
    stage hook sees that stage's calls; this one marks round boundaries. Returns nothing.
    """


STAGE_HOOKS = ("specflow_draft_length", "specflow_node_price", "specflow_propose",
               "specflow_score", "specflow_process_logits", "specflow_mask_logits",
               "specflow_verify", "specflow_trim", "specflow_sync_cache", "specflow_observe")
