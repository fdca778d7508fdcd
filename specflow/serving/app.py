"""The FastAPI app and the uvicorn server behind `specflow serve`.

Endpoints: POST /v1/completions and /v1/chat/completions (stream: true as server-sent events),
GET /v1/models, /health (503 while draining), /metrics (Prometheus text). Under load and faults:
more requests than running slots + server.max_queue get 429 with Retry-After; a prompt longer
than server.max_prompt_tokens or max_tokens above server.max_tokens get 400 naming the field; a
client that disconnects mid-stream aborts its request, which frees its slot at the next round;
SIGTERM / Ctrl-C stop admitting (503) and let requests in flight finish for up to
server.grace_seconds, then abort the rest, and the process exits 0.
"""

import asyncio
import json
import signal
import time
from contextlib import asynccontextmanager

from specflow.errors import ConfigError
from specflow.serving import protocol
from specflow.serving.prometheus import render
from specflow.serving.worker import Draining, EngineWorker, QueueFull, outputs_of


def _imports():
    try:
        import fastapi
        import uvicorn
    except ImportError as exc:
        raise ConfigError(f"specflow serve needs the serve extra ({exc.name} is missing): "
                          f"pip install 'specflow[serve]'") from None
    return fastapi, uvicorn


def chat_prompt_for(tokenizer):
    """messages -> prompt text: the tokenizer's chat template, or a plain transcript when it has
    none (the demo pair was trained on code, not chat)."""
    tok = getattr(tokenizer, "tok", None)
    if tok is not None and getattr(tok, "chat_template", None):
        return lambda messages: tok.apply_chat_template(messages, tokenize=False,
                                                        add_generation_prompt=True)
    return lambda messages: "".join(f"{m['role']}: {m['content']}\n" for m in messages) + \
        "assistant:"


def create_app(pipe, server_cfg):
    fastapi, _ = _imports()
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

    worker = EngineWorker(pipe, int(server_cfg.max_queue))
    context = pipe.target.max_length or 1 << 30
    limit = server_cfg.get("max_prompt_tokens") or context - 1
    limits = protocol.Limits(int(server_cfg.max_tokens), min(int(limit), context - 1))
    model = server_cfg.get("model_name") or str(pipe.cfg.model.get("path") or pipe.cfg.model.name)
    configured = protocol.configured_sampling(pipe.cfg)
    chat_prompt = chat_prompt_for(pipe.tokenizer)
    created = int(time.time())
    grace = float(server_cfg.grace_seconds)

    @asynccontextmanager
    async def lifespan(app):
        worker.start()
        try:
            yield
        finally:        # uvicorn has drained the connections (or given up after the grace)
            await asyncio.get_running_loop().run_in_executor(None, worker.close, grace)

    app = fastapi.FastAPI(title="specflow", lifespan=lifespan)
    app.state.worker = worker

    def error(exc: protocol.BadRequest, headers=None):
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.get("/health")
    async def health():
        if worker.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok", "running": worker.running, "waiting": worker.waiting}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model, "object": "model", "created": created,
                                            "owned_by": "specflow"}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(render(worker), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(request: fastapi.Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: fastapi.Request):
        return await handle(request, chat=True)

    def check_request(parsed) -> None:
        """A request's own sampling values and grammar (compiled now, cached for its run)."""
        from specflow.errors import SpecflowError
        from specflow.stages.request_settings import check_request_sampling

        field = "response_format"
        try:
            for field, value in (parsed.sampling or {}).items():
                check_request_sampling({field: value}, set(pipe.sampling_settings), 0)
            if parsed.grammar is not None:
                field = "response_format"
                if pipe.grammars is None:
                    raise protocol.BadRequest("response_format needs a model with a "
                                              "transformers tokenizer", field)
                pipe.grammars.compile(parsed.grammar, 0)
        except SpecflowError as exc:
            raise protocol.BadRequest(str(exc).removeprefix("prompt 0: "), field) from None

    async def handle(request, chat: bool):
        try:
            body = json.loads(await request.body() or b"null")
        except ValueError:
            return error(protocol.BadRequest("the request body is not valid JSON"))
        try:
            parsed = protocol.parse(body, chat, limits, configured, chat_prompt)
            if body.get("model") not in (None, model):
                raise protocol.BadRequest(f"model={body.get('model')!r} is not served here; "
                                          f"use {model!r} (GET /v1/models)", "model", 404,
                                          "model_not_found")
            counts = [len(pipe.tokenizer.encode(p)) for p in parsed.prompts]
            for c in counts:
                protocol.check_prompt_length(c, limits, "messages" if chat else "prompt")
        except protocol.BadRequest as exc:
            return error(exc)
        loop = asyncio.get_running_loop()
        try:     # checked here, so a bad value is a 400 naming its field, not a failed generation
            await loop.run_in_executor(None, check_request, parsed)
        except protocol.BadRequest as exc:
            return error(exc)
        handles = []
        try:
            for p in parsed.prompts:
                for j in range(parsed.n):
                    handles.append(worker.submit(
                        loop, prompt=p, max_new_tokens=parsed.max_tokens, stop=parsed.stop,
                        seed=None if parsed.seed is None else parsed.seed + j,
                        logprobs=parsed.logprobs, sampling=parsed.sampling,
                        grammar=parsed.grammar))
        except (QueueFull, Draining) as exc:
            for h in handles:
                worker.cancel(h)
            if isinstance(exc, Draining):
                return error(protocol.BadRequest("the server is shutting down; retry on another "
                                                 "instance", None, 503, "server_error"))
            return error(protocol.BadRequest(
                f"the server's queue is full ({worker.in_flight} requests in flight, "
                f"{worker.capacity} running + {worker.max_queue} waiting); retry later", None,
                429, "rate_limit_error"), headers={"Retry-After": "1"})
        rid = protocol.new_id(chat)
        if parsed.stream:
            return StreamingResponse(stream(parsed, handles, rid, sum(counts) * parsed.n),
                                     media_type="text/event-stream")
        try:
            results = await asyncio.gather(*(collect(h) for h in handles))
        except Exception as exc:     # noqa: BLE001 - one request's failure, reported to it alone
            return error(protocol.BadRequest(f"generation failed: {exc}", None, 500,
                                             "server_error"))
        finally:
            for h in handles:        # a client gone mid-request: free what is still running
                worker.cancel(h)
        choices = []
        for i, r in enumerate(results):
            lp = (protocol.chat_logprobs if chat else protocol.completion_logprobs)(
                pipe.tokenizer, r.token_ids, r.logprobs, r.top_logprobs)
            choices.append(protocol.choice(parsed, i, r.text, protocol.FINISH[r.finish_reason],
                                           lp))
        return protocol.body(parsed, rid, model, choices,
                             protocol.usage(sum(counts) * parsed.n, results))

    async def collect(handle):
        async for out in outputs_of(handle):
            if out.finished:
                if out.finish_reason == "abort":
                    raise RuntimeError("the request was aborted")
                return out.result
        raise RuntimeError("the request ended without a result")

    async def stream(parsed, handles, rid, prompt_tokens):
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i, handle):
            try:
                async for out in outputs_of(handle):
                    await merged.put((i, out))
            except Exception as exc:   # noqa: BLE001 - reported in the stream
                await merged.put((i, exc))

        tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
        left, first, results = len(handles), set(), []
        try:
            while left:
                i, out = await merged.get()
                if isinstance(out, Exception) or (out.finished and out.finish_reason == "abort"):
                    left -= 1
                    message = str(out) if isinstance(out, Exception) else "the request was aborted"
                    yield protocol.sse({"error": {"message": f"generation failed: {message}",
                                                  "type": "server_error", "param": None,
                                                  "code": None}})
                    continue
                lp = None
                if out.logprobs is not None:
                    lp = (protocol.chat_logprobs if parsed.chat else protocol.completion_logprobs)(
                        pipe.tokenizer, out.token_ids, out.logprobs, out.top_logprobs)
                if out.text or (parsed.chat and i not in first) or lp:
                    yield protocol.sse(protocol.chunk(parsed, rid, model, i, out.text, None, lp,
                                                      first=i not in first))
                    first.add(i)
                if out.finished:
                    left -= 1
                    results.append(out.result)
                    yield protocol.sse(protocol.chunk(parsed, rid, model, i, None,
                                                      protocol.FINISH[out.finish_reason]))
            if parsed.include_usage:
                use = protocol.usage(prompt_tokens, results)
                yield protocol.sse({"id": rid, "object": "chat.completion.chunk" if parsed.chat
                                    else "text_completion", "created": int(time.time()),
                                    "model": model, "choices": [], "usage": use})
            yield protocol.sse("[DONE]")
        finally:                     # finished, or the client went away mid-stream
            for h in handles:
                worker.cancel(h)
            for t in tasks:
                t.cancel()

    return app


def serve(cfg) -> None:
    """Build the pipeline from the composed config and serve it until SIGTERM / Ctrl-C."""
    _, uvicorn = _imports()
    from specflow.console import console
    from specflow.pipeline import Pipeline

    pipe = Pipeline(cfg)
    server_cfg = cfg.server
    app = create_app(pipe, server_cfg)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            """SIGTERM / Ctrl-C: stop admitting, drain, exit 0 (uvicorn itself would re-raise
            the signal once drained, and the process would die of it); a second Ctrl-C forces."""
            # running requests get an error shortly before uvicorn would cut their connections
            app.state.worker.drain(max(0.0, float(server_cfg.grace_seconds) - 1.0))
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True

    config = uvicorn.Config(app, host=str(server_cfg.host), port=int(server_cfg.port),
                            log_level="warning", timeout_graceful_shutdown=int(
                                server_cfg.grace_seconds), lifespan="on")
    server = Server(config)
    console.print(f"specflow serve: http://{server_cfg.host}:{server_cfg.port} (model "
                  f"{server_cfg.get('model_name') or cfg.model.get('path') or cfg.model.name}, "
                  f"proposer={cfg.proposer.name}, policy={cfg.policy.name}); Ctrl-C or SIGTERM "
                  f"drains and stops", markup=False, highlight=False)
    server.run()
