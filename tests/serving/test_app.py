"""The server's request handling in-process (FastAPI's TestClient over the synthetic pair): OpenAI
fields that change the output are implemented (echo, logit_bias) or refused, logprobs are valid
JSON, requests that can never fit or overrun the context are 400s, text_offset runs across
stream chunks, and /health says when the json_object grammar is still warming."""
from __future__ import annotations

import concurrent.futures
import json
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

from specflow import Pipeline  # noqa: E402
from specflow.config import compose  # noqa: E402
from specflow.errors import InputError  # noqa: E402
from specflow.serving import protocol  # noqa: E402
from specflow.serving.app import create_app  # noqa: E402

CONFIG = ["model=synthetic", "draft=synthetic", "proposer=draft", "proposer.k=3",
          "max_batch_size=4", "max_new_tokens=16"]
LIMITS = ["server.max_prompt_tokens=1000", "server.max_tokens=100000"]
SAMPLING = ["logits=[temperature,top_k]", "logits.temperature.value=1.0", "logits.top_k.k=2"]


def make_app(*overrides: str):
    cfg = compose([*CONFIG, *LIMITS, *overrides], "serve")
    pipe = Pipeline(cfg)
    return pipe, create_app(pipe, cfg.server)


@pytest.fixture(scope="module")
def client():
    """A greedy server: 4 slots, 2 waiting."""
    _, app = make_app("server.max_queue=2")
    with TestClient(app) as c:        # the lifespan: the engine thread starts and stops
        c.app_state = app.state
        yield c


@pytest.fixture(scope="module")
def sampling_client():
    """A sampling server whose top_k=2 leaves every position's other tokens impossible."""
    _, app = make_app(*SAMPLING)
    with TestClient(app) as c:
        yield c


def strict_json(text: str):
    """JSON as RFC 8259 has it: no NaN, Infinity or -Infinity."""
    def refuse(constant):
        raise AssertionError(f"{constant} in JSON: {text[:200]}")
    return json.loads(text, parse_constant=refuse)


def events(c, path: str, body: dict) -> list[dict]:
    with c.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [strict_json(line[6:]) for line in lines[:-1]]


def post_raw(c, path: str, raw: bytes):
    return c.post(path, content=raw, headers={"content-type": "application/json"})


def refused(r, field: str, status: int = 400) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["type"] == "invalid_request_error", err
    return err["message"]


# --- 1. OpenAI fields that change the output: implemented or refused ----------------------------

def test_echo_puts_the_prompt_before_the_completion_plain_and_streamed(client):
    body = {"prompt": ["def fib(n):", "class A:"], "max_tokens": 8, "n": 2}
    plain = client.post("/v1/completions", json=body).json()
    echoed = client.post("/v1/completions", json={**body, "echo": True}).json()
    prompts = [p for p in body["prompt"] for _ in range(2)]
    assert [c["text"] for c in echoed["choices"]] == \
        [p + c["text"] for p, c in zip(prompts, plain["choices"])]
    chunks = events(client, "/v1/completions", {**body, "echo": True})
    for i, want in enumerate(echoed["choices"]):
        assert "".join(e["choices"][0]["text"] for e in chunks
                       if e["choices"][0]["index"] == i) == want["text"]
    # OpenAI would add the prompt's logprobs; this server does not compute them: refused
    message = refused(client.post("/v1/completions", json={**body, "echo": True,
                                                           "logprobs": 1}), "echo")
    assert "logprobs" in message


@pytest.mark.parametrize("path, body, field", [
    ("/v1/completions", {"prompt": "x", "best_of": 2}, "best_of"),
    ("/v1/completions", {"prompt": "x", "suffix": "return x"}, "suffix"),
    ("/v1/completions", {"prompt": "x", "echo": "yes"}, "echo"),
    ("/v1/completions", {"prompt": "x", "ignore_eos": True}, "ignore_eos"),
    ("/v1/completions", {"prompt": "x", "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"echo": True}, "echo"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]},
     "tools"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"reasoning_effort": "high"}, "reasoning_effort"),
    ("/v1/chat/completions", {"suffix": "x"}, "suffix"),
])
def test_fields_that_would_change_the_output_are_refused_by_name(client, path, body, field):
    if path.endswith("chat/completions"):
        body = {"messages": [{"role": "user", "content": "hi"}], **body}
    refused(client.post(path, json={"max_tokens": 4, **body}), field)


@pytest.mark.parametrize("path, extra", [
    ("/v1/completions", {"best_of": 1, "suffix": "", "echo": False, "user": "u1"}),
    ("/v1/completions", {"n": 2, "best_of": 2}),
    ("/v1/chat/completions", {"user": "u1", "metadata": {"k": "v"}, "store": False,
                              "tools": [], "tool_choice": "none", "modalities": ["text"],
                              "parallel_tool_calls": True, "service_tier": "auto"}),
])
def test_harmless_or_neutral_fields_are_taken(client, path, extra):
    body = {"max_tokens": 4, **extra}
    body.update({"messages": [{"role": "user", "content": "hi"}]}
                if path.endswith("chat/completions") else {"prompt": "def f():"})
    assert client.post(path, json=body).status_code == 200


def test_logit_bias_per_request_as_the_library_gives_it(client):
    lib = Pipeline.from_config(CONFIG)
    tok = lib.tokenizer
    body = {"prompt": "def fib(n):", "max_tokens": 8}
    plain = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    first = tok.encode(plain[0])[0]
    banned = client.post("/v1/completions",
                         json={**body, "logit_bias": {str(first): -100}}).json()
    assert banned["choices"][0]["text"][0] != plain[0]
    d = tok.encode("d")[0]
    forced = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
        "logit_bias": {str(d): 100}}).json()
    assert forced["choices"][0]["message"]["content"] == "dddddd"
    want = lib.generate(["def fib(n):"], max_new_tokens=8,
                        sampling={"logit_bias": {first: -100}})[0].text
    assert banned["choices"][0]["text"] == want
    # the next request is not biased
    assert client.post("/v1/completions", json=body).json()["choices"][0]["text"] == plain


@pytest.mark.parametrize("bias, says", [
    ({"64": 1}, "vocabulary (0 to 63)"),
    ({"-1": 1}, "not a token id"),
    ({"a": 1}, "not a token id"),
    ({"5": 101}, "[-100, 100]"),
    ({"5": "1"}, "[-100, 100]"),
    ([5], "must be an object"),
])
def test_bad_logit_bias_is_a_400(client, bias, says):
    r = client.post("/v1/completions", json={"prompt": "x", "logit_bias": bias})
    assert says in refused(r, "logit_bias")


def test_generate_takes_a_logit_bias_and_checks_it():
    pipe = Pipeline.from_config(CONFIG)
    d = pipe.tokenizer.encode("d")[0]
    assert pipe.generate(["x"], max_new_tokens=5,
                         sampling={"logit_bias": {str(d): 100}})[0].text == "ddddd"
    with pytest.raises(InputError, match="vocabulary"):
        pipe.generate(["x"], sampling={"logit_bias": {64: 1.0}})
    with pytest.raises(InputError, match=r"\[-100, 100\]"):
        pipe.generate(["x"], sampling={"logit_bias": {3: float("-inf")}})
    # a configured logit_bias still applies; a request's entry replaces it for the same id
    plain = pipe.generate(["def fib(n):"], max_new_tokens=8)[0].text
    first = pipe.tokenizer.encode(plain[0])[0]
    banned = Pipeline.from_config([*CONFIG, "logits=[logit_bias]",
                                   f"logits.logit_bias.bias={{{first}: -100}}"])
    assert banned.generate(["def fib(n):"], max_new_tokens=8)[0].text[0] != plain[0]
    assert banned.generate(["def fib(n):"], max_new_tokens=8,
                           sampling={"logit_bias": {first: 0}})[0].text == plain


# --- 2. logprobs are JSON: impossible alternatives are left out -------------------------------

def test_masked_alternatives_are_left_out_of_logprobs(sampling_client):
    c = sampling_client
    body = {"prompt": "def fib(n):", "max_tokens": 12, "logprobs": 5, "seed": 3}
    r = c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    lp = strict_json(r.text)["choices"][0]["logprobs"]
    assert lp["top_logprobs"] and all(1 <= len(d) <= 2 for d in lp["top_logprobs"])
    assert all(v > -1e4 for d in lp["top_logprobs"] for v in d.values())
    streamed = [e["choices"][0]["logprobs"] for e in events(c, "/v1/completions", body)
                if e["choices"] and e["choices"][0]["logprobs"]]
    assert [d for s in streamed for d in s["top_logprobs"]] == lp["top_logprobs"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "logprobs": True,
            "top_logprobs": 5, "seed": 3}
    r = c.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200, r.text
    content = strict_json(r.text)["choices"][0]["logprobs"]["content"]
    assert all(1 <= len(t["top_logprobs"]) <= 2 for t in content)
    assert events(c, "/v1/chat/completions", chat)       # every chunk parsed strictly


class ABC:
    def decode(self, ids):
        return "abc"[ids[0] - 1]


def test_chosen_logprobs_never_leave_as_minus_infinity():
    top = [{1: -0.5, 2: float("-inf"), 3: float("nan")}]
    out = protocol.completion_logprobs(ABC(), [1], [float("-inf")], top)
    assert out["token_logprobs"] == [protocol.LOGPROB_FLOOR] and out["top_logprobs"] == [{"a": -0.5}]
    assert protocol.chat_logprobs(ABC(), [1], [float("nan")], top)["content"][0]["logprob"] == \
        protocol.LOGPROB_FLOOR
    strict_json(json.dumps(out))


# --- 3. a request that can never fit: 400 before anything is admitted --------------------------

def test_a_request_bigger_than_slots_and_queue_is_a_400_and_the_next_is_unaffected(client):
    worker = client.app_state.worker
    body = {"prompt": ["def fib(n):", "class A:"], "max_tokens": 8}
    before = client.post("/v1/completions", json=body).json()
    big = {**body, "prompt": body["prompt"] + ["x = 1\n"], "n": 3}      # 9 > 4 slots + 2 waiting
    added = worker.engine.next_id
    message = refused(client.post("/v1/completions", json=big), "n")
    assert "9 sequences" in message and "4 running" in message and "2 waiting" in message
    assert worker.engine.next_id == added and worker.inbox.empty()   # nothing was submitted
    refused(client.post("/v1/completions", json={"prompt": ["x"] * 7}), "prompt")
    after = client.post("/v1/completions", json=body)
    assert after.status_code == 200
    assert [c["text"] for c in after.json()["choices"]] == \
        [c["text"] for c in before["choices"]]
    full = client.post("/v1/completions", json={**body, "n": 3})        # 6: fits exactly
    assert full.status_code == 200 and len(full.json()["choices"]) == 6
    assert 'finish_reason="abort"' not in client.get("/metrics").text


# --- 4. bad values are 400s naming the field, never a traceback --------------------------------

@pytest.mark.parametrize("path, raw, field", [
    ("/v1/completions", b'{"prompt": "a\\ud800b"}', "prompt"),
    ("/v1/completions", b'{"prompt": ["ok", "\\udfff"]}', "prompt"),
    ("/v1/completions", b'{"prompt": "a", "stop": ["\\ud800"]}', "stop"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
     "messages"),
    ("/v1/completions", b'{"prompt": "a", "temperature": Infinity}', "temperature"),
    ("/v1/completions", b'{"prompt": "a", "temperature": NaN}', "temperature"),
    ("/v1/completions", b'{"prompt": "a", "top_k": NaN}', "top_k"),
    ("/v1/completions", b'{"prompt": "a", "top_k": Infinity}', "top_k"),
    ("/v1/completions", b'{"prompt": "a", "top_k": 5.7}', "top_k"),
    ("/v1/completions", b'{"prompt": "a", "top_p": -Infinity}', "top_p"),
    ("/v1/completions", b'{"prompt": "a", "frequency_penalty": NaN}', "frequency_penalty"),
    ("/v1/completions", b'{"prompt": "a", "logit_bias": {"3": NaN}}', "logit_bias"),
    ("/v1/completions", b'{"prompt": "\xc3\xa9"}', "prompt"),     # not in the alphabet
])
def test_bad_values_are_400s_naming_the_field(client, sampling_client, path, raw, field):
    for c in (client, sampling_client):
        refused(post_raw(c, path, raw), field)
    assert client.get("/health").status_code == 200


def test_generate_refuses_a_lone_surrogate():
    pipe = Pipeline.from_config(CONFIG)
    with pytest.raises(InputError, match="prompt 0 is not valid Unicode text: a lone surrogate"):
        pipe.generate(["a\ud800"])
    with pytest.raises(InputError, match="lone surrogate"):
        pipe.generate(["a"], stop=["\udfff"])


# --- 5. prompt + max_tokens over the model's context -------------------------------------------

def test_prompt_and_max_tokens_over_the_context_is_a_400_and_the_default_is_cut_to_fit():
    _, app = make_app("model.max_length=64")
    with TestClient(app) as c:
        prompt = "def fib(n):" * 5          # 55 tokens of 64
        r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 20})
        message = refused(r, "max_tokens")
        assert message.startswith("This model's maximum context length is 64 tokens. However, "
                                  "you requested 75 tokens (55 in the prompt, 20 in the "
                                  "completion).")
        chat = {"messages": [{"role": "user", "content": "def fib(n):" * 4}],   # 61 tokens
                "max_completion_tokens": 20}
        assert "in the messages" in refused(c.post("/v1/chat/completions", json=chat),
                                            "max_completion_tokens")
        ok = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 9}).json()
        assert ok["usage"]["completion_tokens"] == 9
        default = c.post("/v1/completions", json={"prompt": prompt}).json()   # 16 -> 9
        assert default["usage"]["completion_tokens"] == 9
        assert default["choices"][0]["finish_reason"] == "length"
        short = c.post("/v1/completions", json={"prompt": "x"}).json()        # the default
        assert short["usage"]["completion_tokens"] == protocol.Limits(1, 1).default_max_tokens


# --- 6. streamed text_offset continues across chunks -------------------------------------------

def test_streamed_text_offsets_join_to_the_plain_response_s(client):
    body = {"prompt": ["def fib(n):", "class A:"], "max_tokens": 16, "logprobs": 1, "n": 2}
    plain = client.post("/v1/completions", json=body).json()["choices"]
    chunks = events(client, "/v1/completions", body)
    for i, want in enumerate(plain):
        mine = [e["choices"][0]["logprobs"] for e in chunks
                if e["choices"] and e["choices"][0]["index"] == i and e["choices"][0]["logprobs"]]
        assert len(mine) >= 2                    # several chunks, so the offsets had to carry on
        assert [o for lp in mine for o in lp["text_offset"]] == want["logprobs"]["text_offset"]
        assert [t for lp in mine for t in lp["tokens"]] == want["logprobs"]["tokens"]
        text = want["text"]
        assert all(text[o:o + len(t)] == t for o, t in zip(want["logprobs"]["text_offset"],
                                                            want["logprobs"]["tokens"]))


# --- 7. the json_object grammar is compiled at start, in the background ------------------------

class SlowGrammars:
    """Stands in for the grammar stage: the first compile of a spec waits for `release`."""

    def __init__(self):
        self.release = threading.Event()
        self.done: set[str] = set()
        self.compiles: list[str] = []

    def compile(self, spec, index):
        key = json.dumps(spec, sort_keys=True)
        if key in self.done:
            return object()
        self.compiles.append(key)
        assert self.release.wait(30), "never released"
        self.done.add(key)
        return object()


def test_health_says_warming_and_a_request_meanwhile_waits_for_that_compile():
    cfg = compose([*CONFIG, *LIMITS], "serve")
    pipe = Pipeline(cfg)
    pipe.grammars = slow = SlowGrammars()      # the synthetic model has no grammar stage
    app = create_app(pipe, cfg.server)
    body = {"prompt": "def f():", "max_tokens": 4, "response_format": {"type": "json_object"}}
    with TestClient(app) as c, concurrent.futures.ThreadPoolExecutor(1) as pool:
        try:
            health = c.get("/health").json()
            assert health["status"] == "warming" and health["warming"] == ["json_object"]
            assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}) \
                .status_code == 200                       # other requests run meanwhile
            waiting = pool.submit(c.post, "/v1/completions", json=body)
            time.sleep(0.5)
            assert not waiting.done()                     # it waits for the warm-up's compile
        finally:               # before the pool and the server wait for what it holds up
            slow.release.set()
        assert waiting.result(30).status_code == 200
        deadline = time.time() + 10
        while c.get("/health").json()["status"] != "ok" and time.time() < deadline:
            time.sleep(0.05)
        assert c.get("/health").json() == {"status": "ok", "running": 0, "waiting": 0}
    assert slow.compiles == [json.dumps(protocol.JSON_OBJECT, sort_keys=True)]    # once


def test_no_warming_when_switched_off():
    cfg = compose([*CONFIG, *LIMITS, "server.warm_grammars=false"], "serve")
    pipe = Pipeline(cfg)
    pipe.grammars = slow = SlowGrammars()
    with TestClient(create_app(pipe, cfg.server)) as c:
        assert c.get("/health").json()["status"] == "ok"
    assert slow.compiles == []


def test_a_seeded_request_gives_the_same_text_under_goodput_and_load():
    """A trial found a seeded request under policy=goodput (the serving policy) gave different
    text on every call: goodput's k follows measured timings. Its text is now plain sampling's,
    alone or beside other requests."""
    _, app = make_app(*SAMPLING, "policy=goodput", "logits.top_k.k=20")
    body = {"prompt": "def fib(n):", "max_tokens": 24, "seed": 11}
    plain = Pipeline.from_config([*CONFIG, *SAMPLING, "logits.top_k.k=20", "proposer=none",
                                  "~proposer.k"])
    want = plain.generate(["def fib(n):"], max_new_tokens=24, seed=11)[0].text
    with TestClient(app) as c:
        texts = [c.post("/v1/completions", json=body).json()["choices"][0]["text"] for _ in range(2)]
        # beside another sequence in the batch (its first choice is seeded `seed` itself)
        loaded = c.post("/v1/completions", json={**body, "prompt": ["def fib(n):", "x = 1"]}).json()
    assert texts == [want, want]
    assert loaded["choices"][0]["text"] == want
