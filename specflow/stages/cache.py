"""Cache sync for the target: after each round its cache holds every committed token but the last.

The last committed token (the recovered or bonus one) is the next round's first input. Other
stateful stages (the draft model, n-gram index, grammar and penalty state) implement
specflow_sync_cache themselves. A prompt's prefill hands out the target's hidden states where a
stage asked for them (specflow_hidden_layers), through `deliver` (specflow_target_states).
"""
from __future__ import annotations

from specflow.plugins import hookimpl


class TargetCacheSync:
    def __init__(self, target):
        self.target = target
        self.hidden_layers: tuple[int, ...] = ()    # set by the pipeline once it is built
        self.deliver = None                         # states -> None (the pipeline's hook)

    @hookimpl
    def specflow_request_start(self, slot, request):
        self.target.reset(slot)

    @hookimpl
    def specflow_prefill(self, slots, requests):
        prompts = [r.prompt_ids[:-1] for r in requests]
        if not self.hidden_layers:
            self.target.prefill_many(slots, prompts)
            return
        for states in self.target.prefill_many(slots, prompts, self.hidden_layers) or ():
            self.deliver(states)

    @hookimpl
    def specflow_sync_cache(self, batch, result):
        layout = getattr(result, "layout", None)    # a round's result (a test may pass none)
        if layout is not None:               # a tree keeps its accepted path's entries
            layout.keep_cached(self.target, batch, result)
        self.target.truncate(batch.slots, [len(ids) - 1 for ids in batch.token_ids])
