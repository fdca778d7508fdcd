"""`specflow serve` end to end: the openai client against a server on 127.0.0.1 (synthetic pair),
outputs equal to Pipeline.generate's, streaming, bad requests, load, disconnects and SIGTERM."""
from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from specflow import Pipeline  # noqa: E402

SPECFLOW = str(pathlib.Path(sys.executable).with_name("specflow"))
CONFIG = ["model=synthetic", "draft=synthetic", "proposer=draft", "proposer.k=3",
          "max_batch_size=4", "max_new_tokens=16"]
LIMITS = ["server.max_prompt_tokens=1000", "server.max_tokens=100000"]
PROMPTS = ["def fib(n):", "class A:", "x = 1\n", "import os", "q", "return x + y"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`specflow serve` in a subprocess; `kill()` ends it whatever state it is in (the fixtures
    call it after every test, so no server outlives a failure)."""

    def __init__(self, *overrides: str, tmp_path, config=CONFIG):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [SPECFLOW, "serve", *config, *LIMITS, f"server.port={self.port}", *overrides,
             f"hydra.run.dir={tmp_path}/serve-{self.port}", "--quiet"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            self._wait_up()
        except BaseException:
            self.kill()
            raise
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def _wait_up(self) -> None:
        deadline = time.time() + 60
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited: {self.proc.stderr.read()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise AssertionError("server did not come up")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


@pytest.fixture
def start_server(tmp_path):
    """Start servers for one test; each is killed at its end, passed or failed."""
    started: list[Server] = []

    def start(*overrides: str, config=CONFIG) -> Server:
        started.append(Server(*overrides, tmp_path=tmp_path, config=config))
        return started[-1]

    yield start
    for s in started:
        s.kill()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path=tmp_path_factory.mktemp("serve"))
    try:
        yield s
        assert s.stop() == 0
    finally:
        s.kill()


@pytest.fixture(scope="module")
def expected():
    pipe = Pipeline.from_config(CONFIG)
    return {r.prompt: r for r in pipe.generate(PROMPTS)}


def test_completions_equal_generate_plain_and_streamed(server, expected):
    for prompt in PROMPTS[:3]:
        r = server.client.completions.create(model="specflow", prompt=prompt, max_tokens=16)
        assert r.choices[0].text == expected[prompt].text
        assert r.usage.completion_tokens == len(expected[prompt].token_ids)
        spec = r.model_extra["usage"]["speculation"] if "usage" in (r.model_extra or {}) else \
            r.usage.model_extra["speculation"]
        assert spec["num_target_passes"] >= 1
        pieces = list(server.client.completions.create(model="specflow", prompt=prompt,
                                                       max_tokens=16, stream=True))
        assert "".join(c.choices[0].text for c in pieces) == expected[prompt].text
        assert pieces[-1].choices[0].finish_reason in ("stop", "length")


def test_chat_models_health_and_metrics(server):
    r = server.client.chat.completions.create(
        model="specflow", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens <= 5
    chunks = list(server.client.chat.completions.create(
        model="specflow", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
        stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert [m.id for m in server.client.models.list()] == ["specflow"]
    metrics = httpx.get(server.url + "/metrics").text
    assert "specflow_spec_decode_num_accepted_tokens_total" in metrics
    assert 'specflow_spec_decode_num_accepted_tokens_per_pos_total{position="0"}' in metrics


def test_n_seed_and_logprobs(server):
    r = server.client.completions.create(model="specflow", prompt="def f():", max_tokens=6, n=3,
                                         logprobs=2)
    assert len(r.choices) == 3 and [c.index for c in r.choices] == [0, 1, 2]
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(lp.tokens) and all(v <= 0 for v in lp.token_logprobs)


@pytest.mark.parametrize("body, field", [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10 ** 7}, "max_tokens"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": 3}, "prompt"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "temperature": 0.7}, "temperature"),
    ({"prompt": "x", "model": "gpt-9"}, "model"),
    ({"prompt": "x" * 5000}, "prompt"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "logit_bias": {"99999": 5}}, "logit_bias"),
    ({"prompt": ["x"] * 10, "n": 8}, "n"),          # 80 sequences > 4 slots + 64 waiting
    ({"prompt": "x", "top_k": 5.7}, "top_k"),
])
def test_bad_requests_get_an_openai_error_naming_the_field(server, body, field):
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code in (400, 404), r.text
    err = r.json()["error"]
    assert err["param"] == field and err["message"]
    # the server is unharmed
    assert httpx.get(server.url + "/health").status_code == 200


def test_32_concurrent_clients_none_lost_outputs_exact(server, expected):
    def one(i):
        prompt = PROMPTS[i % len(PROMPTS)]
        r = server.client.completions.create(model="specflow", prompt=prompt, max_tokens=16)
        return prompt, r.choices[0].text

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        done = list(pool.map(one, range(32)))
    assert len(done) == 32
    assert all(text == expected[prompt].text for prompt, text in done)


def test_a_client_leaving_mid_stream_frees_its_slot(server):
    body = {"model": "specflow", "prompt": "def long():", "max_tokens": 90000, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break                     # leave after the first chunk
    deadline = time.time() + 20
    while time.time() < deadline:
        if httpx.get(server.url + "/health").json()["running"] == 0:
            break
        time.sleep(0.1)
    assert httpx.get(server.url + "/health").json()["running"] == 0
    assert 'finish_reason="abort"' in httpx.get(server.url + "/metrics").text


def test_sigterm_lets_requests_in_flight_finish_and_exits_0(start_server):
    s = start_server("server.max_queue=2")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(s.client.completions.create, model="specflow", prompt=p,
                               max_tokens=8000) for p in PROMPTS[:4]]
        while httpx.get(s.url + "/health").json()["running"] < 4:
            time.sleep(0.05)
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        try:                # draining: the socket is closed, or an open connection gets 503
            late = httpx.post(s.url + "/v1/completions", json={"prompt": "x"}, timeout=30)
            assert late.status_code == 503
        except httpx.ConnectError:
            pass
        results = [f.result(timeout=120) for f in futures]
    assert [r.choices[0].finish_reason for r in results] == ["length"] * 4
    assert all(r.usage.completion_tokens == 8000 for r in results)
    assert s.proc.wait(60) == 0


def test_requests_outliving_the_grace_period_get_an_error_and_the_server_exits_0(start_server):
    s = start_server("server.grace_seconds=3", "max_batch_size=2")
    body = {"model": "specflow", "prompt": "def long():", "max_tokens": 99000, "stream": True}
    with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: {")
        s.proc.send_signal(signal.SIGTERM)
        rest = list(lines)
    events = [json.loads(x[6:]) for x in rest if x.startswith("data: {")]
    assert "shut down before this request finished" in events[-1]["error"]["message"]
    assert rest[-2:] == ["data: [DONE]", ""] or rest[-1] == "data: [DONE]"
    assert s.proc.wait(30) == 0


def test_a_sampling_server_takes_each_request_s_temperature(start_server):
    sampling = ["logits=[temperature,top_k]", "logits.temperature.value=1.0", "logits.top_k.k=20"]
    s = start_server(*sampling)
    try:
        own = {"temperature": 0.6, "top_k": 5}
        want = Pipeline.from_config([*CONFIG, *sampling]).generate(
            ["def fib(n):"], seed=11, sampling=own)[0].text
        r = s.client.completions.create(model="specflow", prompt="def fib(n):", max_tokens=16,
                                        seed=11, temperature=0.6, extra_body={"top_k": 5})
        assert r.choices[0].text == want
    finally:
        assert s.stop() == 0


def test_response_format_and_penalties_per_request_on_the_demo_pair(start_server):
    """json_schema responses validate, a bad schema is a 400 naming response_format, and a
    request's own penalties give the tokens of a pipeline configured with them (EAGLE head)."""
    import jsonschema

    demo = ["model=demo", "draft=demo", "proposer=eagle", "max_batch_size=4",
            "logits=[frequency_penalty]", "logits.frequency_penalty.value=0",
            "server.warm_grammars=false"]     # no json_object compile: this test has no need
    s = start_server(config=demo)
    try:
        schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                   "ok": {"type": "boolean"}},
                  "required": ["name", "ok"]}
        r = s.client.chat.completions.create(
            model="specflow", messages=[{"role": "user", "content": "# record\n"}],
            max_tokens=60, response_format={"type": "json_schema",
                                            "json_schema": {"name": "rec", "schema": schema}})
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
        bad = httpx.post(s.url + "/v1/completions", timeout=30, json={
            "prompt": "x", "response_format": {"type": "json_schema",
                                               "json_schema": {"schema": {"type": "objekt"}}}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format"
        far = httpx.post(s.url + "/v1/completions", timeout=30,
                         json={"prompt": "x", "frequency_penalty": 5})
        assert far.status_code == 400 and far.json()["error"]["param"] == "frequency_penalty"
        want = Pipeline.from_config(["model=demo", "draft=demo", "proposer=none",
                                     "logits=[frequency_penalty]",
                                     "logits.frequency_penalty.value=1.5"]).generate(
            ["def fib(n):"], max_new_tokens=24)[0].text
        got = s.client.completions.create(model="specflow", prompt="def fib(n):", max_tokens=24,
                                          frequency_penalty=1.5)
        assert got.choices[0].text == want
    finally:
        assert s.stop() == 0


def test_a_full_queue_answers_429_with_retry_after(start_server):
    s = start_server("server.max_queue=0", "max_batch_size=1")
    try:
        body = {"model": "specflow", "prompt": "def long():", "max_tokens": 90000, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            lines = r.iter_lines()       # kept: a dropped iterator closes the connection
            assert next(lines).startswith("data: {")
            assert httpx.get(s.url + "/health").json()["running"] == 1
            busy = httpx.post(s.url + "/v1/completions", json={"prompt": "x"}, timeout=30)
            assert busy.status_code == 429 and busy.headers["Retry-After"] == "1"
            assert busy.json()["error"]["type"] == "rate_limit_error"
    finally:
        assert s.stop() == 0
