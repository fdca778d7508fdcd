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
import signal
from contextlib import asynccontextmanager

from specflow.errors import ConfigError
from specflow.serving import protocol
from specflow.serving.prometheus import render
from specflow.serving.service import Service
from specflow.serving.streaming import events


def _imports():
    try:
        import fastapi
        import uvicorn
    except ImportError as exc:
        raise ConfigError(f"specflow serve needs the serve extra ({exc.name} is missing): "
                          f"pip install 'specflow[serve]'") from None
    return fastapi, uvicorn


def create_app(pipe, server_cfg):
    """The routes: each parses what HTTP brings, calls the service (serving/service.py), and
    turns its answer or its BadRequest into a response."""
    fastapi, _ = _imports()
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

    service = Service(pipe, server_cfg)

    @asynccontextmanager
    async def lifespan(app):
        service.start()
        try:
            yield
        finally:        # uvicorn has drained the connections (or given up after the grace)
            await asyncio.get_running_loop().run_in_executor(None, service.close)

    app = fastapi.FastAPI(title="specflow", lifespan=lifespan)
    app.state.service = service
    app.state.worker = service.worker

    def error(exc: protocol.BadRequest):
        return JSONResponse(exc.body(), status_code=exc.status,
                            headers=getattr(exc, "headers", None))

    @app.get("/health")
    async def health():
        status, body = service.health()
        return JSONResponse(body, status_code=status)

    @app.get("/v1/models")
    async def models():
        return service.models()

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(render(service.worker), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(request: fastapi.Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: fastapi.Request):
        return await handle(request, chat=True)

    async def handle(request, chat: bool):
        loop = asyncio.get_running_loop()
        try:
            try:
                body = json.loads(await request.body() or b"null")
            except ValueError:
                raise protocol.BadRequest("the request body is not valid JSON") from None
            admitted = service.admit(body, chat)
            if admitted.parsed.grammar is not None:   # seconds for a new schema: off the loop
                await loop.run_in_executor(None, service.compile_grammar, admitted.parsed)
            handles = service.submit(loop, admitted)
            rid = protocol.new_id(chat)
            if admitted.parsed.stream:
                return StreamingResponse(events(service, admitted, handles, rid),
                                         media_type="text/event-stream")
            return await service.complete(admitted, handles, rid)
        except protocol.BadRequest as exc:
            return error(exc)

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
        stderr_line(f"specflow serve: loading {model} and choosing its settings; it answers "
                    f"once it prints its address")
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
