"""The engine: requests join and leave a running batch between rounds.

`Pipeline.generate` is one client of it (add every prompt, step until done); a server is another
(add requests as they arrive, stream each step's output, abort on disconnect):

    engine = pipe.engine()
    rid = engine.add_request("def fib(n):", max_new_tokens=32)
    while engine.has_unfinished():
        for out in engine.step():
            print(out.text, end="")          # text deltas; out.result once finished
    engine.close()

Each `step()` admits queued requests into free slots (their prompts prefilled together), runs one
round over every running row, and returns a `RequestOutput` for each request that committed text
or finished. Tokens and text are streamed only once nothing can take them back: a stop string may
begin in one round and complete in a later one, and then the trimmer retracts the tokens it
covers, so a row whose text ends with the start of one of its stop strings holds those tokens
back until the string either completes (they are dropped) or cannot any more (they are sent);
a character split over tokens is held until it completes. The deltas of a request concatenate to
its final `GenerationResult.text` and `token_ids`.

Every per-request resource is released on every exit path: a finished or aborted request gets
`specflow_request_end` at once, and an error or Ctrl-C inside `step()` (or `close()`) ends every
running request with finish_reason "abort" before the exception propagates.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from specflow.config import whole_number
from specflow.errors import InputError
from specflow.metrics import MetricsRecorder
from specflow.request import GenerationResult, Request, Row
from specflow.state import DecodeBatch

if TYPE_CHECKING:
    from specflow.pipeline import Pipeline

CONTEXT = 6     # sent tokens decoded again in front of a stream's new ones (a left context)


@dataclass
class RequestOutput:
    """What one step did for one request."""

    request_id: int
    token_ids: list[int]                 # tokens committed (and safe to show) since the last output
    text: str                            # their text delta
    finished: bool = False
    finish_reason: str | None = None     # "stop" | "eos" | "length" | "abort" once finished
    result: GenerationResult | None = None   # the whole result (stats included) once finished
    logprobs: list[float] | None = None  # of token_ids, when the request asked for logprobs
    top_logprobs: list[dict[int, float]] | None = None


@dataclass
class _Sent:
    tokens: int = 0        # generated tokens already sent
    text: str = ""         # their text, as sent


@dataclass
class _Stream:
    stop: list[str]
    sent: _Sent = field(default_factory=_Sent)


class Engine:
    """A pipeline's running batch, stepped one round at a time. Build with `pipe.engine()`; one
    engine per pipeline at a time (they share the cache slots). `deltas=False`: step() reports
    requests only once they finish (no text is decoded for a running one)."""

    def __init__(self, pipe: "Pipeline", max_batch_size: int | None = None,
                 recorder: MetricsRecorder | None = None, start_hooks: bool = True,
                 deltas: bool = True):
        capacity = whole_number(pipe.cfg.max_batch_size if max_batch_size is None
                                else max_batch_size, "max_batch_size", 1, None,
                                "give how many sequences run at once, e.g. 8", InputError)
        if capacity > pipe.ctx.slots:
            raise InputError(f"max_batch_size={capacity} exceeds the pipeline's "
                             f"{pipe.ctx.slots} slots; set max_batch_size={capacity} in the config")
        pipe.claim_slots(self)
        self.pipe = pipe
        self.capacity = capacity
        self.recorder = recorder or MetricsRecorder(pipe.clock)
        pipe.register(self.recorder, name="metrics")
        self.queue: deque[Request] = deque()
        self.free = list(range(capacity))
        self.active: dict[int, Row] = {}
        self.streams: dict[int, _Stream] = {}
        self.aborted: list[int] = []           # queued requests aborted: reported next step
        self.round_index = 0
        self.next_id = 0
        self.closed = False
        self.on_finish: Callable[[GenerationResult], None] | None = None   # before request_end
        self.config_stop = list(pipe.cfg.stop.get("strings") or []) if pipe.cfg.get("stop") else []
        # a running request's text deltas, decoded each step; a client that reads only the
        # finished results (Pipeline.generate) turns them off: every step would decode its
        # rows' whole text for nothing
        self.deltas = deltas
        if start_hooks:
            pipe.hook.specflow_run_start(pipeline=pipe, requests=[])

    # --- requests ----------------------------------------------------------------------------

    def add_request(self, prompt: str, max_new_tokens: int | None = None,
                    stop: Sequence[str] | None = None, seed: int | None = None,
                    logprobs: int | None = None, request_id: int | None = None,
                    sampling: dict | None = None, grammar: dict | None = None) -> int:
        """Queue a prompt; it joins the running batch at the next step with a free slot.
        Returns its id. `seed`: this request's sampling seed as given (default: the config's
        seed + its id). `sampling`: its own values of the pipeline's sampling processors;
        `grammar`: its own grammar (see Pipeline.generate)."""
        rid = self.next_id if request_id is None else request_id
        if rid in self.streams:
            raise InputError(f"request_id={rid} is already in use; leave it out for a new one")
        request = self.pipe.make_requests([prompt], max_new_tokens, stop, seed, logprobs, [rid],
                                      [sampling], [grammar])[0]
        if seed is not None:
            request.seed = seed           # as given: the same seed, the same tokens
        self.enqueue(request)
        return rid

    def enqueue(self, request: Request) -> None:
        self._check_open()
        self.streams[request.request_id] = _Stream(
            list(self.config_stop if request.stop is None else request.stop))
        self.next_id = max(self.next_id, request.request_id + 1)
        self.queue.append(request)

    def abort(self, request_id: int) -> bool:
        """Stop a request, queued or running: its slot and every stage's state for it are
        released now; the next step reports it finished with reason "abort". -> True; False
        when no queued or running request has this id (never added, finished, or aborted
        already): nothing changes then, since a client may abort after the end."""
        for req in self.queue:
            if req.request_id == request_id:
                self.queue.remove(req)
                self.aborted.append(request_id)
                return True
        for slot, row in list(self.active.items()):
            if row.request.request_id == request_id:
                del self.active[slot]
                self.free.append(slot)
                self.aborted.append(request_id)
                self.recorder.forget(request_id)
                self.pipe.hook.specflow_request_end(slot=slot, request=row.request,
                                                    finish_reason="abort")
                return True
        return False

    def request(self, request_id: int) -> Request | None:
        """The request with this id while it is queued or running, else None."""
        for row in self.active.values():
            if row.request.request_id == request_id:
                return row.request
        return next((r for r in self.queue if r.request_id == request_id), None)

    @property
    def num_running(self) -> int:
        return len(self.active)

    def has_unfinished(self) -> bool:
        return bool(self.queue or self.active or self.aborted)

    # --- the step ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Admit, run one round, finish rows. An exception ends every running request
        (finish_reason "abort") before it propagates."""
        self._check_open()
        try:
            return self._step()
        except BaseException:
            self._abort_all()
            raise

    def _step(self) -> list[RequestOutput]:
        pipe, recorder = self.pipe, self.recorder
        outputs = [RequestOutput(rid, [], "", True, "abort") for rid in self.aborted]
        for rid in self.aborted:
            self.streams.pop(rid, None)
        self.aborted = []
        self._admit()
        if not self.active:
            return outputs
        rows = [self.active[s] for s in sorted(self.active)]
        sampling = [r.request.sampling for r in rows] if any(r.request.sampling for r in rows) \
            else None
        batch = DecodeBatch(
            slots=torch.tensor([r.slot for r in rows], dtype=torch.long),
            request_ids=[r.request.request_id for r in rows],
            token_ids=[r.token_ids for r in rows],
            prompt_lens=[len(r.request.prompt_ids) for r in rows],
            max_new_tokens=[r.request.max_new_tokens for r in rows],
            generators=[r.generator for r in rows], greedy=pipe.round_is_greedy(sampling),
            max_batch_size=self.capacity, shaper=pipe.shape, argmax_kept=pipe.keeps_argmax,
            seeds=torch.tensor([r.request.seed for r in rows], dtype=torch.long)
            if pipe.draws_by_position else None, sampling=sampling)
        out = pipe.step(batch, self.round_index)
        result, trim = out.round, out.trim
        self.round_index += 1
        if any(r.request.logprobs is not None for r in rows):
            pipe.record_logprobs(rows, out.shaped, trim.committed, result.accepted_nodes)
        for b, row in enumerate(rows):
            rid = row.request.request_id
            reason = result.finish_reasons[b]
            if reason is None:
                out = self._delta(row, final=False) if self.deltas else None
                if out is not None:
                    outputs.append(out)
                continue
            retract = trim.retract[b] if trim.retract else 0
            if retract:
                del row.token_ids[len(row.token_ids) - retract:]
                del row.logprobs[len(row.logprobs) - retract:]
                del row.top_logprobs[len(row.top_logprobs) - retract:]
                recorder.retract(rid, retract)
            done = pipe.finish_row(row, reason, recorder)
            out = self._delta(row, final=True, text=done.text)
            out.finished, out.finish_reason, out.result = True, reason, done
            outputs.append(out)
            if self.on_finish is not None:
                self.on_finish(done)
            # the row leaves `active` only once every stage has released it: if one raises,
            # the abort path still ends it for the others
            pipe.hook.specflow_request_end(slot=row.slot, request=row.request, finish_reason=reason)
            del self.active[row.slot]
            self.free.append(row.slot)
            self.streams.pop(rid, None)
            recorder.forget(rid)      # its stats live on in the result; the run's totals stay
        return outputs

    def _admit(self) -> None:
        pipe, recorder = self.pipe, self.recorder
        admitted: list[Row] = []
        while self.queue and self.free:
            req = self.queue.popleft()
            slot = self.free.pop(0)
            gen = None if not pipe.may_sample or pipe.draws_by_position else torch.Generator(
                device=pipe.target.device).manual_seed(req.seed)
            self.active[slot] = row = Row(req, slot, list(req.prompt_ids), gen)
            admitted.append(row)
            recorder.start(req.request_id)
            t0 = time.perf_counter()
            pipe.hook.specflow_request_start(slot=slot, request=req)
            recorder.add_prefill(req.request_id, time.perf_counter() - t0)
        if admitted:     # their prompts, cached together (one batched forward per model)
            t0 = time.perf_counter()
            pipe.hook.specflow_prefill(slots=[r.slot for r in admitted],
                                       requests=[r.request for r in admitted])
            spent, total = time.perf_counter() - t0, sum(len(r.token_ids) for r in admitted)
            for r in admitted:       # the wave's time, shared by prompt length
                recorder.add_prefill(r.request.request_id, spent * len(r.token_ids) / total)

    # --- streaming ---------------------------------------------------------------------------

    def _delta(self, row: Row, final: bool, text: str | None = None) -> RequestOutput | None:
        """The tokens and text of `row` not sent yet and safe to send (all of them if final).

        Incremental: a round decodes the tokens not sent yet behind a few sent ones (CONTEXT,
        so that a tokenizer that drops or merges spaces at the start of a text sees the same
        left context as in the whole text) and sends what that text adds to the sent tokens'
        own; decoding the whole text every round made a long stream quadratic."""
        stream = self.streams[row.request.request_id]
        generated = row.token_ids[len(row.request.prompt_ids):]
        decode, sent = self.pipe.tokenizer.decode, stream.sent
        if final:
            n, shown = len(generated), text if text is not None else decode(generated)
            added = shown[len(sent.text):] if shown.startswith(sent.text) else shown
        else:
            start = max(0, sent.tokens - CONTEXT)
            window = generated[start:]
            before = decode(window[:sent.tokens - start])       # the sent tokens' own text
            n = start + _safe_tokens(window, stream.stop, decode, len(before))
            if n <= sent.tokens:
                return None
            shown = decode(window[:n - start])
            while shown.endswith("\ufffd") and n > sent.tokens:   # a split character
                n -= 1
                shown = decode(window[:n - start])
            if n <= sent.tokens or not shown.startswith(before):
                return None
            added = shown[len(before):]
        out = RequestOutput(row.request.request_id, generated[sent.tokens:n], added)
        if row.request.logprobs is not None:
            out.logprobs = row.logprobs[sent.tokens:n]
            out.top_logprobs = row.top_logprobs[sent.tokens:n] if row.request.logprobs \
                else None
        stream.sent = _Sent(n, sent.text + added)
        return out

    # --- teardown ----------------------------------------------------------------------------

    def _abort_all(self) -> None:
        """End every running row with finish_reason="abort"; the error that got here wins, so a
        stage raising while it releases its state is passed over (it is being torn down)."""
        for slot, row in sorted(self.active.items()):
            try:
                self.pipe.hook.specflow_request_end(slot=slot, request=row.request,
                                                    finish_reason="abort")
            except Exception:   # noqa: BLE001 - the original error is the one to report
                pass
        self.active.clear()

    def close(self) -> None:
        """Abort whatever is still queued or running and hand the slots back to the pipeline."""
        if self.closed:
            return
        self.closed = True
        try:
            self._abort_all()
        finally:
            self.queue.clear()
            self.pipe.unregister(self.recorder)
            self.pipe.release_slots(self)

    def _check_open(self) -> None:
        if self.closed:
            raise InputError("this engine is closed; build another with pipe.engine()")

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _safe_tokens(generated: list[int], stops: list[str], decode, sent_chars: int = 0) -> int:
    """How many of `generated` no later round can take back: all, unless the text ends with the
    start of a stop string; then the tokens wholly before that start (as the trimmer keeps).
    `sent_chars`: the length of text already sent at the front of decode(generated); a stop
    string's start is looked for after it only (the text sent never ends with one: it would
    have been held), so a stream's rounds look at the text they add."""
    if not stops or not generated:
        return len(generated)
    text = decode(generated)
    tail = len(text) - sent_chars
    hold = 0
    for s in stops:
        for n in range(min(len(s) - 1, tail), hold, -1):
            if text.endswith(s[:n]):
                hold = n
                break
    if hold == 0:
        return len(generated)
    cut = len(text) - hold
    lo, hi = 0, len(generated)          # the most tokens whose text ends at or before `cut`
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(decode(generated[:mid])) <= cut:
            lo = mid
        else:
            hi = mid - 1
    return lo
