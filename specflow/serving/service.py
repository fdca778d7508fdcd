"""What the server does with a request, as plain methods the routes call (and tests call without
HTTP): check it (`admit`), hand its sequences to the engine (`submit`), and answer it whole
(`complete`) or as server-sent events (serving/streaming.py). Every refusal is a
protocol.BadRequest naming its field."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from specflow.errors import SpecflowError
from specflow.serving import protocol
from specflow.serving.grammars import GrammarCompiler
from specflow.serving.worker import Draining, EngineWorker, QueueFull, outputs_of


@dataclass
class Admitted:
    """A request that passed every check: parsed, with its prompts' token counts and each
    prompt's completion budget."""

    parsed: protocol.Parsed
    counts: list[int]             # [prompts] prompt tokens
    budgets: list[int]            # [prompts] max_new_tokens each prompt's sequences get

    @property
    def prompt_tokens(self) -> int:
        return sum(self.counts) * self.parsed.n


class Service:
    """The server's state (the pipeline, its worker, the limits, the served model's name) and the
    steps of a request."""

    def __init__(self, pipe, server_cfg):
        self.pipe = pipe
        self.worker = EngineWorker(pipe, int(server_cfg.max_queue))
        context = pipe.target.max_length or 1 << 30
        limit = server_cfg.get("max_prompt_tokens") or context - 1
        self.limits = protocol.Limits(int(server_cfg.max_tokens), min(int(limit), context - 1),
                                      context=pipe.target.max_length,
                                      vocab_size=pipe.target.vocab_size)
        self.model = server_cfg.get("model_name") or str(pipe.cfg.model.get("path")
                                                         or pipe.cfg.model.name)
        self.configured = protocol.configured_sampling(pipe.cfg)
        self.chat_prompt = chat_prompt_for(pipe.tokenizer)
        self.created = int(time.time())
        self.grace = float(server_cfg.grace_seconds)
        self.grammars = None if pipe.grammars is None else GrammarCompiler(pipe.grammars)
        # the json_object grammar takes seconds to compile (tens on a large vocabulary); the
        # server's own constraint=... was compiled with the pipeline
        self.warm = bool(server_cfg.get("warm_grammars", True)) and self.grammars is not None

    # --- start and stop ----------------------------------------------------------------------

    def start(self) -> None:
        self.worker.start()
        if self.warm:
            self.grammars.warm({"json_object": protocol.JSON_OBJECT})

    def close(self) -> None:
        """After uvicorn drained the connections (or gave up after the grace)."""
        self.worker.close(self.grace)

    # --- the read-only endpoints -------------------------------------------------------------

    def health(self) -> tuple[int, dict]:
        if self.worker.draining:
            return 503, {"status": "draining"}
        out = {"status": "ok", "running": self.worker.running, "waiting": self.worker.waiting}
        if self.grammars is not None and self.grammars.warming:   # requests wait or compile
            out.update(status="warming", warming=sorted(self.grammars.warming))
        return 200, out

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model, "object": "model",
                                            "created": self.created, "owned_by": "specflow"}]}

    # --- a request's checks ------------------------------------------------------------------

    def admit(self, body, chat: bool) -> Admitted:
        """Every check a request gets before any of it runs (BadRequest naming the field)."""
        parsed = protocol.parse(body, chat, self.limits, self.configured, self.chat_prompt)
        if body.get("model") not in (None, self.model):
            raise protocol.BadRequest(f"model={body.get('model')!r} is not served here; use "
                                      f"{self.model!r} (GET /v1/models)", "model", 404,
                                      "model_not_found")
        counts = self.count_tokens(parsed, "messages" if chat else "prompt")
        budgets = [protocol.completion_budget(parsed, c, self.limits) for c in counts]
        self.check_fits(parsed)
        # checked here, so a bad value is a 400 naming its field, not a failed generation
        self.check_sampling(parsed)
        return Admitted(parsed, counts, budgets)

    def count_tokens(self, parsed: protocol.Parsed, field: str) -> list[int]:
        counts = []
        for p in parsed.prompts:
            try:
                counts.append(len(self.pipe.tokenizer.encode(p)))
            except SpecflowError as exc:      # text the tokenizer cannot take
                raise protocol.BadRequest(str(exc), field) from None
            protocol.check_prompt_length(counts[-1], self.limits, field)
        return counts

    def check_fits(self, parsed: protocol.Parsed) -> None:
        """A request that could never be held at once is a 400 now, not a 429 (retrying would
        not help) and never rows admitted and then aborted."""
        worker = self.worker
        wanted, room = len(parsed.prompts) * parsed.n, worker.capacity + worker.max_queue
        if wanted > room:
            field = "n" if parsed.n > 1 else ("messages" if parsed.chat else "prompt")
            raise protocol.BadRequest(
                f"this request needs {wanted} sequences ({len(parsed.prompts)} prompt(s) x "
                f"n={parsed.n}), more than this server can hold at once ({worker.capacity} "
                f"running (max_batch_size) + {worker.max_queue} waiting (server.max_queue) = "
                f"{room}); send at most {room} (fewer prompts per request or a smaller n), or "
                f"start the server with a larger max_batch_size or server.max_queue", field)

    def check_sampling(self, parsed: protocol.Parsed) -> None:
        """A request's own sampling values, checked as the engine will check them."""
        from specflow.stages.request_settings import check_request_sampling

        for field, value in (parsed.sampling or {}).items():
            try:
                check_request_sampling({field: value}, set(self.pipe.sampling_settings), 0,
                                       self.pipe.target.vocab_size)
            except SpecflowError as exc:
                raise protocol.BadRequest(str(exc).removeprefix("prompt 0: "), field) from None

    def compile_grammar(self, parsed: protocol.Parsed) -> None:
        """A request's grammar, compiled now (the routes run it in a worker thread; it is
        cached for the request's run)."""
        if self.grammars is None:
            raise protocol.BadRequest("response_format needs a model with a transformers "
                                      "tokenizer", "response_format")
        try:
            self.grammars.compile(parsed.grammar)
        except SpecflowError as exc:
            raise protocol.BadRequest(str(exc).removeprefix("prompt 0: "),
                                      "response_format") from None

    # --- running it --------------------------------------------------------------------------

    def submit(self, loop, admitted: Admitted) -> list:
        """All of the request's sequences to the engine, or none of them -> their handles.
        BadRequest 503 while draining, 429 (with `headers`) when the queue is full."""
        parsed = admitted.parsed
        try:
            return self.worker.submit_many(loop, [dict(
                prompt=p, max_new_tokens=budget, stop=parsed.stop,
                seed=None if parsed.seed is None else parsed.seed + j,
                logprobs=parsed.logprobs, sampling=parsed.sampling, grammar=parsed.grammar)
                for p, budget in zip(parsed.prompts, admitted.budgets) for j in range(parsed.n)])
        except Draining:
            raise protocol.BadRequest("the server is shutting down; retry on another instance",
                                      None, 503, "server_error") from None
        except QueueFull:
            w = self.worker
            busy = protocol.BadRequest(
                f"the server's queue is full ({w.in_flight} requests in flight, {w.capacity} "
                f"running + {w.max_queue} waiting); retry later", None, 429, "rate_limit_error")
            busy.headers = {"Retry-After": "1"}
            raise busy from None

    async def complete(self, admitted: Admitted, handles: list, rid: str) -> dict:
        """The whole response once every sequence has finished (BadRequest 500 if one failed);
        whatever still runs is cancelled on the way out (a client gone mid-request)."""
        parsed = admitted.parsed
        try:
            results = await asyncio.gather(*(collect(h) for h in handles))
        except Exception as exc:     # noqa: BLE001 - one request's failure, reported to it alone
            raise protocol.BadRequest(f"generation failed: {exc}", None, 500,
                                      "server_error") from None
        finally:
            for h in handles:
                self.worker.cancel(h)
        tok = self.pipe.tokenizer
        choices = []
        for i, r in enumerate(results):
            echo = parsed.prompts[i // parsed.n] if parsed.echo else ""
            lp = protocol.chat_logprobs(tok, r.token_ids, r.logprobs, r.top_logprobs) \
                if parsed.chat else protocol.completion_logprobs(
                    tok, r.token_ids, r.logprobs, r.top_logprobs, len(echo))
            choices.append(protocol.choice(parsed, i, echo + r.text,
                                           protocol.FINISH[r.finish_reason], lp))
        return protocol.body(parsed, rid, self.model, choices,
                             protocol.usage(admitted.prompt_tokens, results))


async def collect(handle):
    """The result of one submitted sequence (RuntimeError if it was aborted)."""
    async for out in outputs_of(handle):
        if out.finished:
            if out.finish_reason == "abort":
                raise RuntimeError("the request was aborted")
            return out.result
    raise RuntimeError("the request ended without a result")


def chat_prompt_for(tokenizer):
    """messages -> prompt text: the tokenizer's chat template, or a plain transcript when it has
    none (the demo pair was trained on code, not chat)."""
    tok = getattr(tokenizer, "tok", None)
    if tok is not None and getattr(tok, "chat_template", None):
        return lambda messages: tok.apply_chat_template(messages, tokenize=False,
                                                        add_generation_prompt=True)
    return lambda messages: "".join(f"{m['role']}: {m['content']}\n" for m in messages) + \
        "assistant:"
