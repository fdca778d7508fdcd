"""The FastAPI app and the uvicorn server behind `specflow serve`.

Endpoints: POST /v1/completions and /v1/chat/completions (stream: true as server-sent events),
GET /v1/models, /health (503 while draining; "warming" while the json_object grammar compiles
in the background after start), /metrics (Prometheus text). Under load and faults: more
requests than running slots + server.max_queue get 429 with Retry-After, and one request with
more sequences (prompts x n) than that could ever hold gets 400 before any of them is admitted; a
prompt longer than server.max_prompt_tokens, max_tokens above server.max_tokens, or a prompt and
max_tokens together over the model's context get 400 naming the field; a client that disconnects
mid-stream aborts its request, which frees its slot at the next round; SIGTERM / Ctrl-C stop
admitting (503) and let requests in flight finish for up to server.grace_seconds, then abort the
rest, and the process exits 0.
"""

import asyncio
import json
import logging
import signal
import threading
import time
from contextlib import asynccontextmanager

from specflow.errors import ConfigError, SpecflowError
from specflow.serving import protocol
from specflow.serving.prometheus import render
from specflow.serving.worker import Draining, EngineWorker, QueueFull, outputs_of

log = logging.getLogger("specflow.serve")


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


class GrammarCompiler:
    """Compiles requests' grammars (the grammar stage caches them), one compile per spec at a time:
    a request whose grammar is being compiled (by the warm-up, or by another request) waits for
    that compile instead of starting its own. `warm()` compiles response_format json_object's
    grammar in a background thread at start; `warming` names what is still compiling."""

    def __init__(self, grammars):
        self.grammars = grammars
        self.guard = threading.Lock()
        self.locks: dict[str, list] = {}          # spec -> [lock, holders and waiters]
        self.warming: set[str] = set()

    def compile(self, spec: dict) -> None:
        key = json.dumps(spec, sort_keys=True)
        with self.guard:
            entry = self.locks.setdefault(key, [threading.Lock(), 0])
            entry[1] += 1
        try:
            with entry[0]:
                self.grammars.compile(spec, 0)
        finally:
            with self.guard:
                entry[1] -= 1
                if entry[1] == 0:
                    self.locks.pop(key, None)

    def warm(self, specs: dict[str, dict]) -> threading.Thread:
        self.warming.update(specs)

        def run():
            for name, spec in specs.items():
                try:
                    self.compile(spec)
                except Exception as exc:     # noqa: BLE001 - requests compile it themselves
                    log.warning("precompiling the %s grammar failed: %s", name, exc)
                finally:
                    self.warming.discard(name)

        thread = threading.Thread(target=run, name="specflow-warm", daemon=True)
        thread.start()
        return thread


def create_app(pipe, server_cfg):
    fastapi, _ = _imports()
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

    worker = EngineWorker(pipe, int(server_cfg.max_queue))
    context = pipe.target.max_length or 1 << 30
    limit = server_cfg.get("max_prompt_tokens") or context - 1
    limits = protocol.Limits(int(server_cfg.max_tokens), min(int(limit), context - 1),
                             context=pipe.target.max_length, vocab_size=pipe.target.vocab_size)
    model = server_cfg.get("model_name") or str(pipe.cfg.model.get("path") or pipe.cfg.model.name)
    configured = protocol.configured_sampling(pipe.cfg)
    chat_prompt = chat_prompt_for(pipe.tokenizer)
    created = int(time.time())
    grace = float(server_cfg.grace_seconds)
    grammars = None if pipe.grammars is None else GrammarCompiler(pipe.grammars)
    # the json_object grammar takes seconds to compile (tens on a large vocabulary); the server's
    # own constraint=... was compiled with the pipeline
    warm = server_cfg.get("warm_grammars", True) and grammars is not None   # checked at compose

    @asynccontextmanager
    async def lifespan(app):
        worker.start()
        if warm:
            grammars.warm({"json_object": protocol.JSON_OBJECT})
        try:
            yield
        finally:        # uvicorn has drained the connections (or given up after the grace)
            await asyncio.get_running_loop().run_in_executor(None, worker.close, grace)

    app = fastapi.FastAPI(title="specflow", lifespan=lifespan)
    app.state.worker = worker
    app.state.grammars = grammars

    def error(exc: protocol.BadRequest, headers=None):
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.get("/health")
    async def health():
        if worker.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        out = {"status": "ok", "running": worker.running, "waiting": worker.waiting}
        if grammars is not None and grammars.warming:   # requests meanwhile wait or compile
            out.update(status="warming", warming=sorted(grammars.warming))
        return out

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

    def check_sampling(parsed) -> None:
        """A request's own sampling values, checked as the engine will check them."""
        from specflow.stages.request_settings import check_request_sampling

        for field, value in (parsed.sampling or {}).items():
            try:
                check_request_sampling({field: value}, set(pipe.sampling_settings), 0,
                                       pipe.target.vocab_size)
            except SpecflowError as exc:
                raise protocol.BadRequest(str(exc).removeprefix("prompt 0: "), field) from None

    def compile_grammar(parsed) -> None:
        """A request's grammar, compiled now (in a worker thread; cached for its run)."""
        if grammars is None:
            raise protocol.BadRequest("response_format needs a model with a transformers "
                                      "tokenizer", "response_format")
        try:
            grammars.compile(parsed.grammar)
        except SpecflowError as exc:
            raise protocol.BadRequest(str(exc).removeprefix("prompt 0: "),
                                      "response_format") from None

    def count_tokens(parsed, field: str) -> list[int]:
        counts = []
        for p in parsed.prompts:
            try:
                counts.append(len(pipe.tokenizer.encode(p)))
            except SpecflowError as exc:      # text the tokenizer cannot take
                raise protocol.BadRequest(str(exc), field) from None
            protocol.check_prompt_length(counts[-1], limits, field)
        return counts

    def check_fits(parsed) -> None:
        """A request that could never be held at once is a 400 now, not a 429 (retrying would
        not help) and never rows admitted and then aborted."""
        wanted, room = len(parsed.prompts) * parsed.n, worker.capacity + worker.max_queue
        if wanted > room:
            field = "n" if parsed.n > 1 else ("messages" if parsed.chat else "prompt")
            raise protocol.BadRequest(
                f"this request needs {wanted} sequences ({len(parsed.prompts)} prompt(s) x "
                f"n={parsed.n}), more than this server can hold at once ({worker.capacity} "
                f"running (max_batch_size) + {worker.max_queue} waiting (server.max_queue) = "
                f"{room}); send at most {room} (fewer prompts per request or a smaller n), or "
                f"start the server with a larger max_batch_size or server.max_queue", field)

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
            counts = count_tokens(parsed, "messages" if chat else "prompt")
            budgets = [protocol.completion_budget(parsed, c, limits) for c in counts]
            check_fits(parsed)
            # checked here, so a bad value is a 400 naming its field, not a failed generation
            check_sampling(parsed)
        except protocol.BadRequest as exc:
            return error(exc)
        loop = asyncio.get_running_loop()
        if parsed.grammar is not None:
            try:        # seconds for a new schema: off the event loop
                await loop.run_in_executor(None, compile_grammar, parsed)
            except protocol.BadRequest as exc:
                return error(exc)
        try:            # all of the request's sequences, or none of them
            handles = worker.submit_many(loop, [dict(
                prompt=p, max_new_tokens=budget, stop=parsed.stop,
                seed=None if parsed.seed is None else parsed.seed + j,
                logprobs=parsed.logprobs, sampling=parsed.sampling, grammar=parsed.grammar)
                for p, budget in zip(parsed.prompts, budgets) for j in range(parsed.n)])
        except Draining:
            return error(protocol.BadRequest("the server is shutting down; retry on another "
                                             "instance", None, 503, "server_error"))
        except QueueFull:
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
            echo = parsed.prompts[i // parsed.n] if parsed.echo else ""
            lp = protocol.chat_logprobs(pipe.tokenizer, r.token_ids, r.logprobs,
                                        r.top_logprobs) if chat else \
                protocol.completion_logprobs(pipe.tokenizer, r.token_ids, r.logprobs,
                                             r.top_logprobs, len(echo))
            choices.append(protocol.choice(parsed, i, echo + r.text,
                                           protocol.FINISH[r.finish_reason], lp))
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
        offsets = [0] * len(handles)      # each choice's text so far: logprobs' text_offset
        try:
            if parsed.echo:               # the prompt first, as its choice's own text
                for i in range(len(handles)):
                    offsets[i] = len(parsed.prompts[i // parsed.n])
                    yield protocol.sse(protocol.chunk(parsed, rid, model, i,
                                                      parsed.prompts[i // parsed.n], None))
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
                if out.logprobs is not None and parsed.chat:
                    lp = protocol.chat_logprobs(pipe.tokenizer, out.token_ids, out.logprobs,
                                                out.top_logprobs)
                elif out.logprobs is not None:
                    lp = protocol.completion_logprobs(pipe.tokenizer, out.token_ids,
                                                      out.logprobs, out.top_logprobs, offsets[i])
                    offsets[i] = protocol.text_end(lp, offsets[i])
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


def bind_socket(host: str, port: int):
    """The server's address, bound now, before the model loads: a port in use, a privileged port
    or an address this machine lacks is one line (ConfigError), never uvicorn's log line and exit
    1 after the model loaded. -> the bound socket, which uvicorn then listens on."""
    import errno
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET     # as uvicorn picks it
    try:
        address = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM)[0][4]
    except socket.gaierror as exc:
        raise ConfigError(f"server.host={host!r} does not resolve ({exc.strerror}); give an IP "
                          f"address or a host name this machine resolves") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        where = f"{host}:{port}"
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(f"server.port={port}: {where} is already in use (another server?); "
                              f"stop that process or pick a free port, e.g. server.port=0 (any "
                              f"free port)") from None
        if exc.errno == errno.EACCES:
            raise ConfigError(f"server.port={port}: listening on {where} is not permitted (ports "
                              f"below 1024 need privileges); use a port >= 1024, e.g. "
                              f"server.port=8000") from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise ConfigError(f"server.host={host!r} is not an address of this machine; use "
                              f"127.0.0.1, 0.0.0.0 (every interface) or one of its own "
                              f"addresses") from None
        raise ConfigError(f"cannot listen on {where} ({exc.strerror}); check server.host and "
                          f"server.port") from None
    sock.set_inheritable(True)
    return sock


def serve(cfg) -> None:
    """Bind the address, build the pipeline from the composed config and serve it until SIGTERM /
    Ctrl-C. The banner comes once the socket is bound and the pipeline built."""
    _, uvicorn = _imports()
    from specflow.app.progress import Heartbeat, stderr_line
    from specflow.console import console
    from specflow.pipeline import Pipeline

    server_cfg = cfg.server
    sock = bind_socket(str(server_cfg.host), int(server_cfg.port))
    try:
        model = server_cfg.get("model_name") or cfg.model.get("path") or cfg.model.name
        stderr_line(f"specflow serve: loading {model} and choosing its settings; it answers once it "
            f"prints its address")
        with Heartbeat(stderr_line, "loading the model", every=30.0):
            pipe = Pipeline(cfg)
        app = create_app(pipe, server_cfg)

        class Server(uvicorn.Server):
            def handle_exit(self, sig, frame):
                """SIGTERM / Ctrl-C: stop admitting, drain, exit 0 (uvicorn itself would
                re-raise the signal once drained, and the process would die of it); a second
                Ctrl-C forces."""
                # running requests get an error shortly before uvicorn would cut their connections
                app.state.worker.drain(max(0.0, float(server_cfg.grace_seconds) - 1.0))
                if self.should_exit and sig == signal.SIGINT:
                    self.force_exit = True
                self.should_exit = True

        host, port = sock.getsockname()[:2]         # port 0: the one the system picked
        config = uvicorn.Config(app, host=host, port=port, log_level="warning",
                                timeout_graceful_shutdown=int(server_cfg.grace_seconds),
                                lifespan="on")
        server = Server(config)
        shown = str(server_cfg.host)
        url = f"http://[{shown}]:{port}" if ":" in shown else f"http://{shown}:{port}"
        console.print(f"specflow serve: {url} (model {model}, "
                      f"proposer={cfg.proposer.name}, policy={cfg.policy.name}); Ctrl-C or SIGTERM "
                      f"drains and stops", markup=False, highlight=False)
        server.run(sockets=[sock])
    finally:
        sock.close()
