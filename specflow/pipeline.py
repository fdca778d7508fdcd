"""The round loop (docs/design.md §2). Nothing here is model- or proposer-specific.

    policy -> k [B] -> propose -> score (target pass) -> shape -> verify -> trim -> sync -> observe

Every stage is called through this pipeline's own plugin manager. Requests are scheduled with
continuous batching: up to `max_batch_size` run at once, a finished row's slot is refilled from the
queue at the next round, and every row has its own k, its own length and its own end.

Host syncs (device to host reads): at most two per round, and none inside stages' tensor work.
1. the drafts, once, after the proposer (`Proposal.host_draft_token_ids`): the target pass's
   inputs, lengths and cache bookkeeping are per-row ints. None when drafts are made on the host
   (the n-gram proposer), and none for a chain whose proposer counted its drafts
   (`Proposal.draft_counts`: the draft model's and the EAGLE head's chains): the pass takes the
   drafts where they are, and they are checked on the device;
2. the verifier's output, the empty-row flags and those device checks, in one read after
   verification (`Pipeline._to_host`): which rows finish and what is committed decide the next
   round.
Asking for logprobs adds one read of the committed tokens' logprobs. tests/test_host_syncs.py
counts them with a probe.
"""
from __future__ import annotations

import time
from typing import Callable, Iterable, Iterator, Sequence

import torch
from omegaconf import DictConfig

from specflow import groups
from specflow.config import check_token_ids, compose, validate, whole_number
from specflow.build import BuildContext, build_component, build_draft, check_tree_width, \
    preflight, resolve_device, retiming
from specflow.engine import Engine
from specflow.errors import ConfigError, InputError, PluginError
from specflow.metrics import MetricsRecorder
from specflow.backends.contract import Backend, SimClock
from specflow.backends.lean.native import row_max
from specflow.request import LOGPROB_FLOOR, GenerationResult, Request, Row
from specflow.plugins import blame, check_hooks, get_registry, new_plugin_manager
from specflow.stages.cache import TargetCacheSync
from specflow.stages.empty_rows import EmptyDistributionError, EmptyRowLog, ShapeCall, describe, \
    mark_empty
from specflow.stages.logits import asks_to_sample, has_temperature, is_greedy
from specflow.stages.request_settings import check_request_sampling
from specflow.stages.score import TargetScorer
from specflow.stages.layout import along_paths, check_proposal, deferred_problem, scored_nodes
from specflow.state import DecodeBatch, Proposal, RoundResult, Scores, ShapingBatch, StepOutput, \
    VerifyOutput


class Pipeline:
    """A composed speculative decoding pipeline. Build with `Pipeline.from_config(overrides=[...])`."""

    def __init__(self, cfg: DictConfig, plugins: Iterable[object] = ()):
        try:
            with retiming(cfg):
                self._construct(cfg, plugins)
        except Exception as exc:
            blamed = blame(exc, "while the pipeline was built", pm=getattr(self, "pm", None))
            if blamed is None:
                raise
            raise blamed from exc

    def _construct(self, cfg: DictConfig, plugins: Iterable[object]) -> None:
        self.cfg = validate(cfg)
        if self.cfg.get("engine", "specflow") != "specflow":
            raise ConfigError(f"engine={self.cfg.engine}: a Pipeline is specflow's own engine; "
                              f"run the config with `specflow run` or `specflow ab` (they hand "
                              f"engine=vllm arms to vLLM), or drop engine=")
        self.registry = get_registry()
        self.pm = new_plugin_manager()
        self.hook = self.pm.hook
        self.greedy = is_greedy(cfg.get("logits"))
        # greedy by default (temperature 0) with a temperature processor: a request may still
        # ask for its own temperature, and a round with such a row samples (the others one-hot)
        self.samples_on_request = self.greedy and has_temperature(cfg.get("logits"))
        # sampling draws keyed by (seed, position): the standard verifier's default rule (a
        # plugin verifier without `rule` gets per-request generator streams, as before)
        self.draws_by_position = self.may_sample and \
            (cfg.get("verifier") or {}).get("rule") == "coupled"
        self.clock = SimClock()
        self.empty_rows = EmptyRowLog()     # this round's shape() calls, checked after verify
        # the round's outputs reach the host in one copy, except on a CPU, where they are host
        # tensors already; True: copied there too (a device's path, for the host-read tests)
        self.copy_outputs_to_host = False
        self.sampling_settings: list[str] = []   # what a request may set for itself (sampling=)
        self._engine: Engine | None = None      # the Engine using the cache slots (one at a time)
        self.hidden_layers: tuple[int, ...] = ()   # target layers whose states stages read
        ctx = BuildContext(cfg=cfg, slots=int(cfg.max_batch_size), clock=self.clock,
                           device=resolve_device(str(cfg.device)), hook=self.hook)
        preflight(self.cfg)
        ctx.target = self.target = self._build("model", ctx)
        self._check_k_fits(cfg)
        check_token_ids(cfg, self.target.vocab_size)   # stop ids, bad words, logit bias keys
        spec_k = scored_nodes(cfg.proposer) if cfg.get("proposer") is not None \
            and cfg.proposer.name != "none" else 0
        # the backend chooses what it may (CPU threads, weight layout) for the passes this
        # pipeline runs: up to k+1 positions in each of max_batch_size rows
        self.target.tune(rows=int(cfg.max_batch_size), positions=spec_k + 1, settings=cfg)
        ctx.tokenizer = self.tokenizer = self.target.tokenizer
        if cfg.get("draft") is not None:
            ctx.build_draft = lambda: self._build_draft(ctx)
        self.ctx = ctx

        self.speculates = cfg.proposer.name != "none"
        self.no_speculation_reason = f"proposer={cfg.proposer.name}"
        self.scorer, self.target_cache = TargetScorer(self.target), TargetCacheSync(self.target)
        self._register(self.scorer, "score.target")
        self._register(self.target_cache, "cache.target")
        for kind in groups.STAGES:
            if cfg.get(kind) is not None:
                self._register(self._build(kind, ctx), f"{kind}.{cfg[kind].name}")
        self.grammars = self._grammar_stage(ctx)     # compiles requests' own grammars
        # pluggy calls the last registered first: register in reverse so config order holds
        for key, node in reversed(list((cfg.get("logits") or {}).items())):
            processor = self._build_node("logits", node, ctx)
            if self.greedy and not self.samples_on_request and getattr(processor, "samples", False):
                continue   # cannot change the argmax
            if getattr(processor, "key", ""):
                self.sampling_settings.append(processor.key)
            self._register(processor, f"logits.{key}")
        if "logit_bias" not in self.sampling_settings:   # requests' own logit_bias (sampling=)
            from specflow.stages.penalties import RequestLogitBias
            self._register(RequestLogitBias(ctx), "logit_bias.request")
            self.sampling_settings.append("logit_bias")
        # observers (a tracer, an exporter) come last: a wrapper=True observer wraps every stage
        for key, node in (cfg.get("observer") or {}).items():
            self._register(self._build_node("observer", node, ctx), f"observer.{key}")
        for plugin in plugins:
            self.pm.register(plugin)
        check_hooks(self.pm)
        self._ask_hidden_layers()
        self.hook.specflow_pipeline_built(pipeline=self)

    # --- construction ----------------------------------------------------------------------

    @property
    def draft(self) -> Backend | None:
        """The draft model (built on first use)."""
        return self.ctx.draft

    @property
    def backends(self) -> dict:
        """How the target (and the draft model, once built) run: their `describe()`, for
        metrics.json. Reading it does not build the draft model."""
        built = {"target": self.target.describe()}
        if self.ctx._draft is not None:
            built["draft"] = self.ctx._draft.describe()
        named = self.cfg.get("proposer")
        proposer = self.pm.get_plugin(f"proposer.{named.name}") if named is not None else None
        if callable(getattr(proposer, "describe", None)):     # a draft head: its file and dtype
            built["proposer"] = proposer.describe()
        named = self.cfg.get("policy")
        policy = self.pm.get_plugin(f"policy.{named.name}") if named is not None else None
        if callable(getattr(policy, "describe", None)) and (said := policy.describe()):
            built["policy"] = said                 # goodput: where its timed costs came from
        return built

    @property
    def threads(self) -> int:
        """torch's CPU threads, as the target's tune() chose them (`threads` in the config)."""
        return self.target.describe().get("threads", torch.get_num_threads())

    @property
    def packed(self) -> bool:
        """Whether the target's weights are packed for oneDNN (`pack`; CPU lean forward)."""
        return bool(self.target.describe().get("packed", False))

    @property
    def draft_packed(self) -> bool:
        """Whether any pass of the draft model runs packed; False before it is built."""
        draft = self.ctx._draft
        return bool(draft.describe().get("packed", False)) if draft is not None else False

    @property
    def kernels(self) -> str | None:
        """The product forms the target's lean forward timed and chose (they round apart)."""
        return self.target.describe().get("kernels")

    def _ask_hidden_layers(self) -> None:
        """The target layers whose states stages read (specflow_hidden_layers): the target's
        passes compute them and the pipeline hands them out (specflow_target_states)."""
        asked = sorted({int(i) for layers in self.hook.specflow_hidden_layers() if layers
                        for i in layers})
        if not asked:
            return
        if not self.target.supports_hidden_states:
            raise ConfigError(f"a stage reads the target's hidden states (layers {asked}), but "
                              f"the target backend {type(self.target).__name__} does not hand "
                              f"them out; use model=demo or model=hf")
        top = self.target.num_layers
        outside = [i for i in asked if i < 0 or (top is not None and i > top)]
        if outside:
            fix = "non-negative indices" if top is None else \
                f"0..{top - 1} (the input of a layer) or {top} (the final normed state)"
            raise ConfigError(f"a stage reads the target's hidden states of layers {outside}, "
                              f"but the target has {top} layers; ask for {fix}")
        self.hidden_layers = tuple(asked)
        self.scorer.hidden_layers = self.target_cache.hidden_layers = self.hidden_layers
        self.target_cache.deliver = lambda states: self.hook.specflow_target_states(states=states)

    def _grammar_stage(self, ctx: BuildContext):
        """The grammar stage that takes requests' own grammars: the configured constraint, or an
        unconfigured one registered for them (None where the tokenizer gives no grammar
        vocabulary: the synthetic model's, backends/contract.py)."""
        from specflow.backends.contract import grammar_vocabulary
        from specflow.constraints.grammar import GrammarConstraint

        for plugin in self.pm.get_plugins():
            if isinstance(plugin, GrammarConstraint):
                return plugin
        if grammar_vocabulary(self.tokenizer, self.target.eos_token_id) is None:
            return None
        stage = GrammarConstraint(None, ctx)
        self._register(stage, "constraint.request")
        return stage

    def _check_k_fits(self, cfg: DictConfig) -> None:
        limit = self.target.max_length
        k = int(cfg.proposer.get("k", 0)) if cfg.get("proposer") is not None else 0
        if limit is not None and k + 1 >= limit:
            raise ConfigError(f"proposer.k={k} leaves no room in the model's {limit}-token "
                              f"context; use a k well below {limit}")
        nodes = cfg.proposer.get("num_draft_tokens") if cfg.get("proposer") is not None else None
        if limit is not None and nodes is not None and int(nodes) + 1 >= limit:
            raise ConfigError(f"proposer.num_draft_tokens={nodes} leaves no room in the model's "
                              f"{limit}-token context; use a node budget well below {limit}")
        check_tree_width(cfg.get("proposer"), limit, "the model's")

    @classmethod
    def from_config(cls, overrides: Sequence[str] = (), config_name: str = "config",
                    plugins: Iterable[object] = ()) -> "Pipeline":
        """Compose conf/<config_name>.yaml with Hydra overrides and build the pipeline."""
        return cls(compose(overrides, config_name), plugins)

    def _build_draft(self, ctx: BuildContext):
        return build_draft(self.cfg["draft"], ctx)   # built on first use, after the pipeline

    def _build(self, kind: str, ctx: BuildContext):
        return self._build_node(kind, self.cfg[kind], ctx)

    def _build_node(self, kind: str, node, ctx: BuildContext):
        return build_component(kind, node, ctx)

    def _register(self, stage, name: str) -> None:
        if stage is not None:
            self.pm.register(stage, name=name)

    # --- the engine that runs it --------------------------------------------------------------

    @property
    def running_engine(self) -> Engine | None:
        """The Engine that holds this pipeline's cache slots, if one is open."""
        return self._engine

    @property
    def recorder(self) -> MetricsRecorder | None:
        """The running engine's metrics (None when none runs)."""
        return None if self._engine is None else self._engine.recorder

    def claim_slots(self, engine: Engine) -> None:
        """An engine takes the cache slots: one engine at a time, or they would share them."""
        if self._engine is not None:
            raise InputError("this pipeline already has a running engine (they would share its "
                             "cache slots); close() it first, or build a second pipeline")
        self._engine = engine

    def release_slots(self, engine: Engine) -> None:
        if self._engine is engine:
            self._engine = None

    def register(self, plugin: object, name: str | None = None) -> None:
        """Add an observer or stage to this pipeline (a tracing plugin, a test probe); one that
        reads the target's hidden states (specflow_hidden_layers) gets them from the next pass."""
        self.pm.register(plugin, name=name)
        check_hooks(self.pm)
        if hasattr(plugin, "specflow_hidden_layers"):
            self._ask_hidden_layers()

    def unregister(self, plugin: object) -> None:
        """Remove what register() added (an engine's metrics when it closes)."""
        self.pm.unregister(plugin)

    # --- the shaping call draft and target share ---------------------------------------------

    def shape(self, logits: torch.Tensor, token_ids: list[list[int]], draft_token_ids: torch.Tensor,
              first_draft_index: int, request_ids: list[int], source: str,
              paths: list[list[int]] | None = None,
              sampling: list[dict | None] | None = None, greedy: bool = False) -> torch.Tensor:
        """Grammar masks, then logit processors in config order: [B, P, V] -> [B, P, V] float32.

        Masks come first (as in vLLM and outlines), so top-k / top-p / min-p truncate among the
        tokens the grammar allows and never leave a row empty by themselves. A row that still
        ends with no finite logit (or a NaN) is marked and replaced by zeros; the round's check
        raises EmptyDistributionError if the round actually reached it (stages/empty_rows.py).
        sampling: [B] each row's request's own settings (DecodeBatch.sampling), or None.
        greedy: a greedy round (DecodeBatch.greedy): sampling processors leave the logits alone.
        """
        shaping = ShapingBatch(logits.float(), token_ids, draft_token_ids, first_draft_index,
                               request_ids, source, sampling, greedy)
        if source == "target":     # the model's own verdict, before a stage may edit in place
            raw_max = row_max(shaping.logits)                                         # [B, P]
        self.hook.specflow_mask_logits(shaping=shaping)
        self.hook.specflow_process_logits(shaping=shaping)
        # the stages made a new tensor (or the input was converted): edit it without a copy
        owned = shaping.logits is not logits
        shaped, unusable = mark_empty(shaping.logits, inplace=owned)                 # [B, P, V]
        if source == "target":
            # a draft row is never an error by itself: its stand-in q is exact (the draft is
            # sampled from it), and the target's row at the same prefix decides
            self.empty_rows.add(ShapeCall(source, list(request_ids), token_ids, draft_token_ids,
                                          first_draft_index, unusable, raw_max, paths,
                                          sampling, greedy))
        return shaped

    def keeps_argmax(self, request_ids: list[int], sampling: list[dict | None] | None,
                     greedy: bool) -> bool:
        """shape() leaves the argmax of these rows' logits as the model's own: a greedy round
        whose every shaping stage says so (its `keeps_argmax(request_ids, sampling, greedy)`:
        no bias, grammar or penalty on these rows); a stage without that method, or a wrapper
        around the shaping hooks, may change it. A proposer may then take a draft's argmax
        without the shaping call (backends' greedy_steps)."""
        if not greedy:
            return False
        for hook in (self.hook.specflow_mask_logits, self.hook.specflow_process_logits):
            for impl in hook.get_hookimpls():
                check = getattr(impl.plugin, "keeps_argmax", None)
                if impl.hookwrapper or getattr(impl, "wrapper", False) or check is None \
                        or not check(request_ids, sampling, greedy):
                    return False
        return True

    def _shaping_stages(self) -> list[tuple[str, Callable]]:
        """The shaping hook implementations in the order shape() calls them (no wrappers)."""
        stages = []
        for hook in (self.hook.specflow_mask_logits, self.hook.specflow_process_logits):
            for impl in reversed(hook.get_hookimpls()):     # pluggy calls the last one first
                if not (impl.hookwrapper or getattr(impl, "wrapper", False)):
                    stages.append((impl.plugin_name, impl.function))
        return stages

    def _check_empty_rows(self, batch: DecodeBatch, consumed: list[int],
                          accepted: list[list[int]] | None = None) -> None:
        """Raise for a shaped position with no usable token that plain decoding would have
        sampled from: position p of row b counts when p < consumed[b] (accepted drafts plus the
        recovered or bonus token, cut after an EOS or stop) and, in a tree, the position lies
        on the accepted path (`accepted`: each row's accepted nodes)."""
        hit = self.empty_rows.first_counted(batch.request_ids, consumed, accepted)
        if hit is None:
            return
        call, row, position = hit
        prompt_len = batch.prompt_lens[batch.request_ids.index(call.request_ids[row])]
        n_out = len(call.token_ids[row]) - prompt_len + call.first_draft_index + position
        raise EmptyDistributionError(describe(call, row, position, self._shaping_stages(),
                                              self.target.vocab_size, n_out))

    # --- generation --------------------------------------------------------------------------

    def make_requests(self, prompts, max_new_tokens, stop, seed, logprobs,
                      indices=None, sampling=None, grammar=None) -> list[Request]:
        """Checked Requests for generate()'s arguments (one line for anything wrong), each with
        its tokens, room in the context, seed (seed + index), sampling settings and grammar."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if isinstance(prompts, (bytes, dict)) or not hasattr(prompts, "__iter__"):
            raise InputError(f"prompts={prompts!r} is not a prompt; pass a string or a list of "
                             f"strings")
        prompts = list(prompts)
        if not prompts:
            raise InputError("no prompts given; pass at least one prompt")
        for i, prompt in enumerate(prompts):
            if not isinstance(prompt, str):
                raise InputError(f"prompt {i} is of type {type(prompt).__name__}, not text; pass "
                                 f"prompts as strings (decode token ids first)")
            check_unicode(prompt, f"prompt {i}")
        max_new = _whole(self.cfg.max_new_tokens if max_new_tokens is None else max_new_tokens,
                         "max_new_tokens", 1, "give the most tokens to generate, e.g. 64")
        if stop is not None:
            stop = [stop] if isinstance(stop, str) else stop
            if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
                raise InputError(f"stop={stop!r} must be a string or a list of strings")
            stop = list(stop)
            if any(s == "" for s in stop):
                raise InputError("a stop string is empty, which would stop at once; remove it")
            for s in stop:
                check_unicode(s, "a stop string")
        base_seed = _whole(self.cfg.seed if seed is None else seed, "seed", 0,
                           "give a non-negative seed")
        logprobs = self.cfg.get("logprobs") if logprobs is None else logprobs
        if logprobs is not None:
            logprobs = _whole(logprobs, "logprobs", 0, "use None (off), 0 (the chosen tokens "
                              "only) or n (also the top n)")
            if logprobs > self.target.vocab_size:
                raise InputError(f"logprobs={logprobs} exceeds the vocabulary "
                                 f"({self.target.vocab_size}); ask for fewer")
        limit = self.target.max_length
        if indices is None:
            indices = range(len(prompts))
        try:
            indices = [int(i) for i in indices]
        except (TypeError, ValueError):
            raise InputError(f"indices={indices!r} must be a list of ints, one per prompt") from None
        if len(indices) != len(prompts) or len(set(indices)) != len(indices):
            raise InputError(f"indices must give one distinct index per prompt "
                             f"({len(indices)} for {len(prompts)} prompts)")
        if sampling is None or isinstance(sampling, dict):
            sampling = [sampling] * len(prompts)
        elif not isinstance(sampling, (list, tuple)) or len(sampling) != len(prompts) \
                or not all(s is None or isinstance(s, dict) for s in sampling):
            raise InputError(f"sampling must be a dict (every prompt) or a list of dicts or "
                             f"None, one per prompt ({len(prompts)})")
        configured = set(self.sampling_settings)
        try:
            sampling = [check_request_sampling(s, configured, i, self.target.vocab_size)
                        if s else None
                        for i, s in zip(indices, sampling)]
        except ConfigError as exc:
            raise InputError(str(exc)) from None
        grammar = self._request_grammars(grammar, indices)
        requests, lowered = [], []
        for i, prompt, own in zip(indices, prompts, sampling):
            if not prompt:
                raise InputError(f"prompt {i} is empty; every prompt needs at least one character")
            ids = list(self.tokenizer.encode(prompt))
            if not ids:
                raise InputError(f"prompt {i} encodes to no tokens; give a non-empty prompt")
            if limit is not None and len(ids) >= limit:
                raise InputError(f"prompt {i} has {len(ids)} tokens but the model's context is "
                                 f"{limit}; shorten the prompt")
            room = max_new if limit is None else min(max_new, limit - len(ids))
            if room < max_new:
                lowered.append((i, len(ids), room))
            requests.append(Request(i, prompt, ids, room, stop, base_seed + i,
                                    None if logprobs is None else int(logprobs), own,
                                    grammar[len(requests)]))
        if lowered:
            warn_lowered(lowered, max_new, limit)
        return requests

    def _request_grammars(self, grammar, indices: list[int]) -> list[dict | None]:
        """One grammar (or None) per prompt, each compiled now (cached), so a bad one is an
        InputError here and never an error inside the round loop."""
        n = len(indices)
        if grammar is None or isinstance(grammar, dict):
            grammar = [grammar] * n
        elif not isinstance(grammar, (list, tuple)) or len(grammar) != n:
            raise InputError(f"grammar must be a dict (every prompt) or a list of dicts or None, "
                             f"one per prompt ({n})")
        if any(g is not None for g in grammar) and self.grammars is None:
            raise InputError(f"grammar= needs a tokenizer that spells its tokens as bytes "
                             f"(Tokenizer.grammar_vocabulary), and "
                             f"{type(self.tokenizer).__name__} gives none; use model=demo or "
                             f"model=hf")
        for i, g in zip(indices, grammar):
            if g is not None:
                self.grammars.compile(g, i)
        return list(grammar)

    def generate(self, prompts: Sequence[str] | str, max_new_tokens: int | None = None,
                 stop: Sequence[str] | None = None, seed: int | None = None,
                 max_batch_size: int | None = None, progress: bool = False,
                 logprobs: int | None = None,
                 on_result: Callable[[GenerationResult], None] | None = None,
                 indices: Sequence[int] | None = None,
                 sampling: dict | Sequence[dict | None] | None = None,
                 grammar: dict | Sequence[dict | None] | None = None) -> list[GenerationResult]:
        """Generate a continuation of every prompt; results come back in prompt order.

        logprobs: None (off), 0 (each returned token's logprob under the target's shaped
        distribution, the one it was verified against) or n (also the top n alternatives).
        on_result: called with each result as its request finishes (write it out, stream it).
        sampling: a request's own temperature / top_k / top_p / min_p, for all prompts (a dict)
        or per prompt (a list of dicts or None), in a sampling pipeline whose config has those
        processors (their configured values apply to the rest); temperature 0 makes that row
        greedy; the repetition / frequency / presence penalties likewise, greedy or not.
        grammar: a request's own grammar, for all prompts or per prompt: {"json_schema": schema},
        {"regex": pattern} or {"choice": [strings]}; it replaces the configured constraint for
        that request. Speculation stays exact per row: draft and target share the shaping call.
        indices: each prompt's index in a larger list (default 0..n-1). A request's index is its
        result's `index` and its seed offset (seed + index), so resuming the unfinished part of a
        list reproduces the whole list's output (greedy always; sampling too under the default
        verifier.rule=coupled, whose draws depend only on the seed and the position; under
        rule=rejection only when draft lengths do not depend on the other requests).
        """
        requests = self.make_requests(prompts, max_new_tokens, stop, seed, logprobs, indices,
                                  sampling, grammar)
        engine = Engine(self, max_batch_size, start_hooks=False, deltas=False)
        bar = _progress(len(requests)) if progress else None
        results: dict[int, GenerationResult] = {}

        def finished(result: GenerationResult) -> None:     # before its request_end hook
            results[result.index] = result
            if on_result is not None:
                on_result(result)
            if bar is not None:
                bar[0].advance(bar[1])

        engine.on_finish = finished
        try:
            self.hook.specflow_run_start(pipeline=self, requests=requests)
            for request in requests:
                engine.enqueue(request)
            while engine.has_unfinished():
                engine.step()
            self.last_stats = engine.recorder.total.as_dict()
            ordered = [results[r.request_id] for r in requests]
            self.hook.specflow_run_end(pipeline=self, results=ordered, stats=self.last_stats)
        except Exception as exc:   # a plugin raising inside a hook is named with its package
            blamed = blame(exc, pm=self.pm)
            if blamed is None:
                raise
            raise blamed from exc
        finally:
            if bar is not None:    # also on Ctrl-C or an error: give the terminal back
                bar[0].stop()
            engine.close()          # every row still running ends with "abort"
        return ordered

    def engine(self, max_batch_size: int | None = None) -> Engine:
        """A running batch that takes requests between rounds (`specflow.engine.Engine`):
        add_request(), abort(), step(), has_unfinished(), close(). One per pipeline at a time."""
        return Engine(self, max_batch_size)

    def stream(self, prompt: str, max_new_tokens: int | None = None,
               stop: Sequence[str] | None = None, seed: int | None = None,
               sampling: dict | None = None, grammar: dict | None = None) -> Iterator[str]:
        """Yield the text of one prompt's continuation as rounds commit it (held back where a
        stop string may still form); the pieces join to generate()'s text for the same prompt.
        Closing the iterator early aborts the request and frees its slot."""
        with self.engine(1) as engine:
            engine.add_request(prompt, max_new_tokens, stop, seed, sampling=sampling,
                               grammar=grammar)
            while engine.has_unfinished():
                for out in engine.step():
                    if out.text:
                        yield out.text
                    if out.finished:
                        self.last_stats = engine.recorder.total.as_dict()

    def finish_row(self, row: Row, reason: str, recorder: MetricsRecorder) -> GenerationResult:
        """A row that ended `reason` as the GenerationResult its caller receives."""
        generated = row.token_ids[len(row.request.prompt_ids):]
        text = self.tokenizer.decode(generated)        # text always agrees with token_ids
        stats = recorder.requests[row.request.request_id].as_dict()
        want = row.request.logprobs
        return GenerationResult(row.request.request_id, row.request.prompt, text, generated,
                                reason, stats,
                                logprobs=None if want is None else row.logprobs,
                                top_logprobs=None if not want else row.top_logprobs)

    def _cap_k(self, k: torch.Tensor, batch: DecodeBatch) -> tuple[torch.Tensor, list[str | None]]:
        """No more drafts than the tokens a row may still commit, minus the recovered/bonus one."""
        asked = k.tolist()
        ks = list(asked)
        reasons: list[str | None] = []
        for b in range(batch.size):
            left = batch.max_new_tokens[b] - batch.num_generated(b) - 1
            if ks[b] > left:
                ks[b] = max(left, 0)
            reasons.append(None if ks[b] > 0 else ("policy" if asked[b] == 0 else "length cap"))
        if not self.speculates:
            reasons = [self.no_speculation_reason] * batch.size
        return torch.tensor(ks, dtype=torch.long), reasons

    def _check_price(self, price, size: int) -> list[float]:
        """A node price [B] as host floats in [0, 1], or PluginError naming the policy."""
        values = torch.as_tensor(price, dtype=torch.float64).flatten().tolist()
        bad = next((v for v in values if not 0.0 <= v <= 1.0), None)   # NaN fails both
        if len(values) != size or bad is not None:
            name = self.cfg.policy.name
            got = f"{len(values)} values" if len(values) != size else f"a price of {bad}"
            raise PluginError(f"policy {name!r} (or a plugin answering specflow_node_price) "
                              f"returned {got} for {size} rows; return one chance of acceptance "
                              f"in [0, 1] per row, or None")
        return values

    def _proposer_error(self, problem: str):
        name = self.cfg.proposer.name
        owner = self.registry.get("proposer", name).plugin
        raise PluginError(f"proposer {name!r} (or a plugin answering specflow_propose; "
                          f"configured one from {owner}) {problem}: fix the proposer")

    def step(self, batch: DecodeBatch, round_index: int) -> StepOutput:
        """One round over a running batch (its rows' committed tokens grow in place) -> the
        round's record, the stop trimmer's verdict and the target's shaped distributions that
        record_logprobs reads. What the engine calls between admitting and finishing."""
        try:
            return self._run_round(batch, round_index)
        finally:        # nothing recorded outlives its round (an error, Ctrl-C included)
            self.empty_rows.clear()

    def _run_round(self, batch: DecodeBatch, round_index: int) -> StepOutput:
        """policy -> propose -> score -> shape -> verify -> trim -> sync -> observe."""
        hook, clock = self.hook, RoundClock(self.clock)
        k, skip_reasons = self._draft_lengths(batch)                                 # [B]
        asked = k.tolist()                                   # what each row was asked to draft
        clock.mark("policy")
        proposal = hook.specflow_propose(batch=batch, k=k) or Proposal.empty(batch.size)
        proposal, layout, num_drafts = self._checked(proposal, batch, asked, skip_reasons)  # sync 1
        clock.mark("propose", less=proposal.catch_up_seconds)
        logits = self._score(batch, proposal)                                      # [B, P, V]
        clock.mark("target")
        # prefix processors and grammars walk the drafts on the host (read once if on a device)
        shaped = layout.shape(self.shape, logits, batch, proposal.round_drafts())
        probs = shaped if batch.greedy else shaped.softmax(-1)   # greedy reads only the argmax
        verified = hook.specflow_verify(batch=batch, proposal=proposal, target_probs=probs)
        verified, flagged = self._to_host(verified, proposal)   # what the round decided
        if flagged is not None and any(flagged):    # a counted chain's drafts were bad
            self._proposer_error(deferred_problem(proposal, flagged, batch, asked, self.target))
        clock.mark("verify")
        trim = hook.specflow_trim(batch=batch, verified=verified)
        accepted = layout.accepted_paths(verified)
        # before the committed tokens join the prefixes the shape calls recorded
        self._check_empty_rows(batch, trim.consumed if trim.consumed is not None
                               else (verified.num_accepted + 1).tolist(),
                               layout.shaped_on_path(accepted))
        for ids, new in zip(batch.token_ids, trim.committed):
            ids.extend(new)
        clock.mark("trim")
        result = RoundResult(
            round_index=round_index, request_ids=batch.request_ids, num_drafts=num_drafts,
            num_accepted=verified.num_accepted.tolist(), committed=trim.committed,
            finish_reasons=trim.finish_reasons, batch_size=batch.size, skip_reasons=skip_reasons,
            sim_time=clock.sim_time(), drawn=trim.consumed, num_asked=asked, layout=layout,
            **layout.round_fields(accepted))
        hook.specflow_sync_cache(batch=batch, result=result)
        clock.mark("sync")
        result.seconds = clock.seconds(prefill=proposal.catch_up_seconds)
        hook.specflow_observe(result=result)
        hook.specflow_round_end(result=result, pipeline=self)
        return StepOutput(result, trim, shaped)

    def _draft_lengths(self, batch: DecodeBatch) -> tuple[torch.Tensor, list[str | None]]:
        """The policy's k [B], capped by what each row may still commit, the node price on the
        batch, and why each row that will not draft does not."""
        k = self.hook.specflow_draft_length(batch=batch)
        if k is None:
            k = torch.zeros(batch.size, dtype=torch.long)
        k, skip_reasons = self._cap_k(k, batch)                                    # [B]
        price = self.hook.specflow_node_price(batch=batch, k=k)
        batch.node_price = None if price is None else self._check_price(price, batch.size)
        return k, skip_reasons

    def _checked(self, proposal: Proposal, batch: DecodeBatch, asked: list[int],
                 skip_reasons: list[str | None]):
        """The proposal read to the host and checked (PluginError naming the proposer) ->
        (the proposal to score, its layout, drafts or nodes per row); rows asked for drafts
        that got none get the proposer's reason."""
        proposal, layout, num_drafts, problem = check_proposal(proposal, batch, asked,
                                                               self.target)
        if problem:
            self._proposer_error(problem)
        for b, n in enumerate(num_drafts):   # asked for drafts, got none: say why
            if n == 0 and skip_reasons[b] is None:
                given = proposal.skip_reasons[b] if proposal.skip_reasons else None
                skip_reasons[b] = given or "no proposal"
        return proposal, layout, num_drafts

    def _score(self, batch: DecodeBatch, proposal: Proposal) -> torch.Tensor:
        """The target pass -> logits [B, P, V]; hidden states it computed for the stages that
        asked go out through specflow_target_states first."""
        scores = self.hook.specflow_score(batch=batch, proposal=proposal)
        if not isinstance(scores, Scores):
            return scores
        for states in scores.hidden:
            self.hook.specflow_target_states(states=states)
        return scores.logits

    def _to_host(self, verified: VerifyOutput, proposal: Proposal
                 ) -> tuple[VerifyOutput, list[bool] | None]:
        """The verifier's output, this round's empty-row flags and a counted chain's draft
        checks (stages/layout.py), moved to the host in one read -> (the output, the rows whose
        drafts failed the check, or None when the drafts were checked on the host).

        Everything after verification (stop checks, the empty-row check, commits, cache sync,
        policies) is host logic over a handful of ints per row; reading them together makes the
        round's last host sync (and its only one when the drafts stayed on the device). On a
        CPU they are host tensors already, taken as they are. A shape call whose rows were all
        usable (unusable None) has nothing to read.
        """
        calls = [c for c in self.empty_rows.calls if c.unusable is not None]
        checks = proposal._unchecked[0] if proposal._unchecked is not None else None
        outputs = [verified.out_token_ids, verified.num_accepted, verified.accepted_nodes]
        device = verified.out_token_ids.device
        if device.type == "cpu" and not self.copy_outputs_to_host:   # cpu only: host already
            host = [p if p is None or p.dtype == torch.long else p.long()       # cpu only
                    for p in outputs]
            for call in calls:
                call.unusable = call.unusable.bool().cpu()                      # cpu only
            flagged = None if checks is None else checks.bool().cpu().tolist()  # cpu only
            return VerifyOutput(*host), flagged
        parts = [p for p in outputs if p is not None] + [c.unusable for c in calls] + \
            ([checks] if checks is not None else [])
        flat = torch.cat([p.to(device).long().flatten() for p in parts]).cpu()         # [N]
        pieces = iter(piece.view(p.shape) for piece, p in
                      zip(flat.split([p.numel() for p in parts]), parts))
        host = [None if p is None else next(pieces) for p in outputs]
        for call in calls:
            call.unusable = next(pieces).bool()
        flagged = None if checks is None else next(pieces).bool().tolist()
        return VerifyOutput(*host), flagged

    @property
    def may_sample(self) -> bool:
        """Whether any round may sample: a sampling pipeline, or one that samples on request."""
        return not self.greedy or self.samples_on_request

    def round_is_greedy(self, sampling: list[dict | None] | None) -> bool:
        """Greedy pipelines decode greedily, unless one samples on request and a row of this
        round asked for a temperature above 0 (its other rows are then one-hot: still greedy)."""
        return self.greedy and not (self.samples_on_request and asks_to_sample(sampling))

    def record_logprobs(self, rows: list[Row], shaped: torch.Tensor,
                         committed: list[list[int]],
                         accepted_nodes: list[list[int]] | None = None) -> None:
        """Logprobs of the committed tokens: committed token j was verified at position j (of
        the accepted path, for a tree)."""
        lp = along_paths(shaped, accepted_nodes).float().log_softmax(-1)             # [B, K+1, V]
        for b, (row, new) in enumerate(zip(rows, committed)):
            n_top = row.request.logprobs
            if n_top is None or not new:
                continue
            ids = torch.tensor(new, device=lp.device)
            chosen = lp[b, :len(new)].gather(-1, ids[:, None])[:, 0].clamp(min=LOGPROB_FLOOR)
            row.logprobs += chosen.tolist()
            if n_top:    # alternatives a mask or a processor left impossible are left out
                values, tokens = lp[b, :len(new)].topk(n_top, -1)
                row.top_logprobs += [{t: v for t, v in zip(ts, vs) if v > float("-inf")}
                                     for ts, vs in zip(tokens.tolist(), values.tolist())]

    def __repr__(self) -> str:
        names = [name for name, _ in self.pm.list_name_plugin()]
        return f"Pipeline(greedy={self.greedy}, stages={names})"


class RoundClock:
    """Wall seconds of a round's stages (marks between them) and the simulated clock's units."""

    def __init__(self, sim: SimClock):
        self.sim, self.sim_before = sim, dict(sim.by_source)
        self.last = time.perf_counter()
        self.marks: dict[str, float] = {}

    def mark(self, stage: str, less: float = 0.0) -> None:
        """The time since the last mark is `stage`'s (less `less` seconds spent on other work)."""
        now = time.perf_counter()
        self.marks[stage] = now - self.last - less
        self.last = now

    def sim_time(self) -> dict[str, float]:
        before = self.sim_before
        return {s: v - before.get(s, 0.0) for s, v in self.sim.by_source.items()
                if v != before.get(s, 0.0)}

    def seconds(self, prefill: float = 0.0) -> dict[str, float]:
        """The marks, with prefill work a proposer did (caching prompts) as its own entry."""
        return {**self.marks, **({"prefill": prefill} if prefill else {})}


def check_unicode(text: str, what: str) -> None:
    """InputError for text that is not valid Unicode: a lone surrogate (a JSON "\\ud800", a
    filename decoded with surrogateescape) has no UTF-8 form and no tokenizer takes it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InputError(f"{what} is not valid Unicode text: a lone surrogate "
                         f"{text[exc.start]!r} at character {exc.start}; send UTF-8 text (pair "
                         f"surrogates, or drop it)") from None


def warn_lowered(lowered: list[tuple[int, int, int]], max_new: int, limit: int) -> None:
    """One line on stderr for a call whose prompts leave less room in the context than
    max_new_tokens: those requests can end with "length" sooner than asked."""
    import sys

    index, tokens, cap = lowered[0]
    n = len(lowered) - 1
    more = f" (and for {n} more prompt{'s' if n > 1 else ''})" if n else ""
    print(f"specflow: warning: prompt {index} has {tokens} tokens and the model's context is "
          f"{limit}, so max_new_tokens={max_new} is lowered to {cap} for it{more}; shorten the "
          f"prompt or ask for fewer tokens", file=sys.stderr, flush=True)


def _whole(value, name: str, lo: int, fix: str) -> int:
    """An int argument of generate(), checked as the config's root scalars are."""
    return whole_number(value, name, lo, None, fix, InputError)


def _progress(total: int):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    bar = Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), transient=True)
    task = bar.add_task("generating", total=total)
    bar.start()
    return bar, task
