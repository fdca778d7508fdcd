"""`SpecflowProposer`: a specflow proposer and policy as vLLM's `custom_class` drafter.

    LLM(model, speculative_config={"method": "custom_class",
                                   "model": "specflow.vllm.SpecflowProposer",
                                   "num_speculative_tokens": k})

with the specflow overrides in the environment (`SPECFLOW_VLLM_OVERRIDES="proposer=ngram
policy=adaptive"`; vLLM's worker processes inherit it). vLLM builds the class with its VllmConfig
and, after every step, calls `propose` with each row's tokens; the class answers each row's draft
token ids. Between two calls a row's new tokens are the verdict on its drafts: the accepted ones,
then the target's own token. So each call is one specflow round for every row that advanced:

    sync_cache (the new tokens) -> observe (drafted, accepted) -> draft_length -> propose

Requests are followed across rows by their tokens (`rows.RowTracker`); each gets a specflow slot
and request id of its own, so per-request state (an n-gram index, a policy's estimate) follows it.
vLLM verifies every draft itself: greedy output is vLLM's plain greedy output.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import torch

from specflow.errors import SpecflowError
from specflow.request import Request
from specflow.state import PAD, DecodeBatch, RoundResult
from specflow.vllm.rows import RowTracker, Tracked
from specflow.vllm.stages import OVERRIDES_ENV, HistoryStages, read_overrides


def _request(state: Tracked, max_model_len: int) -> Request:
    """specflow's Request for a followed request: its prompt ids and the tokens it may still add
    (vLLM knows its max_tokens; the drafter knows only the context left)."""
    return Request(request_id=state.key, prompt="", prompt_ids=state.tokens[:state.prompt_len],
                   max_new_tokens=max_model_len - state.prompt_len, stop=None, seed=0)


class SpecflowProposer:
    """vLLM's custom_class drafter running specflow's proposer and policy (module docstring)."""

    def __init__(self, vllm_config, *args, overrides: list[str] | None = None, **kwargs):
        self.k_max = int(vllm_config.speculative_config.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        slots = int(vllm_config.scheduler_config.max_num_seqs)
        try:
            self.stages = self.stages_for(vllm_config, overrides)
        except SpecflowError as exc:
            # vLLM's front end checked this already (specflow/vllm/plugin.py) unless the plugin
            # was left out (VLLM_PLUGINS); in a worker, vLLM wraps the refusal in tracebacks:
            # the line, on its own, where a user can find it
            print(f"specflow: error: {exc}", file=sys.stderr, flush=True)
            raise
        self.hook = self.stages.hook
        self.rows = RowTracker(slots)
        self.rounds = 0
        # what this drafter did, for comparison with vLLM's own counters
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0

    @classmethod
    def stages_for(cls, vllm_config, overrides: list[str] | None = None) -> HistoryStages:
        """The proposer and policy this drafter runs for a VllmConfig (overrides: those of
        SPECFLOW_VLLM_OVERRIDES unless given); ConfigError, one line, for what vLLM cannot host.
        vLLM's front end calls it through specflow's plugin before any engine process starts."""
        if overrides is None:
            overrides = read_overrides(os.environ.get(OVERRIDES_ENV))
        return HistoryStages.build(overrides, int(vllm_config.speculative_config.num_speculative_tokens),
                                   int(vllm_config.scheduler_config.max_num_seqs))

    def load_model(self, *args, **kwargs) -> None:
        """vLLM asks every drafter to load its model; a history proposer has none."""

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None,
                **kwargs) -> list[list[int]]:
        """sampled_token_ids [R][n_r]: what each row committed this step (empty: a row still in
        prefill); num_tokens_no_spec [>=R]; token_ids_cpu [>=R, max_model_len]. -> [R][<=k]."""
        tracker = self.rows
        tracker.begin_step()
        R = len(sampled_token_ids)
        states: list[tuple[int, Tracked, bool]] = []            # (row, state, started now)
        for row in range(R):
            new = len(sampled_token_ids[row])
            if not new:
                continue
            n = int(num_tokens_no_spec[row])
            state, started = tracker.match(row, np.asarray(token_ids_cpu[row, :n]), new)
            states.append((row, state, started))
        self._end(tracker.end_absent())
        drafts: list[list[int]] = [[] for _ in range(R)]
        if not states:
            return drafts
        started = [s for _, s, new in states if new]
        if started:
            requests = [_request(s, self.max_model_len) for s in started]
            for s, r in zip(started, requests):
                self.hook.specflow_request_start(slot=s.slot, request=r)
            self.hook.specflow_prefill(slots=[s.slot for s in started], requests=requests)
        self._commit([(row, s) for row, s, _ in states],
                     [np.asarray(token_ids_cpu[row, :int(num_tokens_no_spec[row])])
                      for row, _, _ in states])
        live = [s for _, s, _ in states]
        batch = self._batch(live)
        k = self.hook.specflow_draft_length(batch=batch)
        if k is None:
            k = torch.zeros(batch.size, dtype=torch.long)
        ks = [max(0, min(int(kb), self.k_max, self.max_model_len - len(s.tokens)))
              for kb, s in zip(k.tolist(), live)]                                       # [B]
        proposal = self.hook.specflow_propose(batch=batch, k=torch.tensor(ks, dtype=torch.long))
        ids = proposal.host_draft_token_ids() if proposal is not None else None        # [B, K]
        for b, ((row, _, _), s) in enumerate(zip(states, live)):
            d = [] if ids is None or b >= ids.shape[0] else ids[b, :ks[b]].tolist()
            d = d[:d.index(PAD)] if PAD in d else d
            s.drafts, s.drafted, s.asked = d, True, ks[b]
            drafts[row] = d
        return drafts

    # --- one round per call ---------------------------------------------------------------------

    def _commit(self, rows: list[tuple[int, Tracked]], tokens: list[np.ndarray]) -> None:
        """Each row's new tokens into its state (sync_cache), and the verdict on what it drafted
        last call to the policy (observe)."""
        advanced: list[tuple[Tracked, list[int], int | None]] = []   # (state, new, accepted)
        for (_, s), toks in zip(rows, tokens):
            new = [int(t) for t in toks[len(s.tokens):]]
            if not new:
                continue
            acc = None
            if s.drafted:             # the new tokens: the accepted drafts, then the target's
                acc = 0
                while acc < min(len(s.drafts), len(new) - 1) and s.drafts[acc] == new[acc]:
                    acc += 1
                self.num_drafts += bool(s.drafts)
                self.num_draft_tokens += len(s.drafts)
                self.num_accepted_tokens += acc
            s.extend(new)
            advanced.append((s, new, acc))
        if not advanced:
            return
        self.hook.specflow_sync_cache(batch=self._batch([s for s, _, _ in advanced]),
                                      result=self._result(advanced))
        verdicts = [a for a in advanced if a[2] is not None]
        if verdicts:
            self.hook.specflow_observe(result=self._result(verdicts))
        for s, _, _ in advanced:
            s.drafts, s.drafted, s.asked = [], False, 0
        self.rounds += 1

    def _result(self, rows: list[tuple[Tracked, list[int], int | None]]) -> RoundResult:
        k = [len(s.drafts) if acc is not None else 0 for s, _, acc in rows]
        return RoundResult(
            round_index=self.rounds, request_ids=[s.key for s, _, _ in rows], num_drafts=k,
            num_accepted=[acc or 0 for _, _, acc in rows], committed=[new for _, new, _ in rows],
            finish_reasons=[None] * len(rows), batch_size=len(rows),
            skip_reasons=[None if kb else "policy" for kb in k],
            num_asked=[s.asked if acc is not None else 0 for s, _, acc in rows])

    def _batch(self, states: list[Tracked]) -> DecodeBatch:
        return DecodeBatch(
            slots=torch.tensor([s.slot for s in states], dtype=torch.long),
            request_ids=[s.key for s in states], token_ids=[s.tokens for s in states],
            prompt_lens=[s.prompt_len for s in states],
            max_new_tokens=[self.max_model_len - s.prompt_len for s in states],
            generators=[None] * len(states), greedy=True, max_batch_size=self.rows.slots)

    def _end(self, ended: list[Tracked]) -> None:
        for s in ended:
            self.hook.specflow_request_end(slot=s.slot, request=_request(s, self.max_model_len),
                                           finish_reason="stop")

    def close(self) -> None:
        """End every request still followed (their per-request state released)."""
        self._end(self.rows.end_all())

    def stats(self) -> dict:
        """What this drafter proposed and saw accepted (its own count; vLLM counts too)."""
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens, "rounds": self.rounds}
