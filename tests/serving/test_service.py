"""The server's request steps called directly, without HTTP (specflow/serving/service.py): what
admit() refuses and with which field and status, what a full queue and a draining server answer,
and a whole request run through submit() and complete()."""
from __future__ import annotations

import asyncio

import pytest

from specflow import Pipeline
from specflow.config import compose
from specflow.serving import protocol
from specflow.serving.service import Service

CONFIG = ["model=synthetic", "draft=synthetic", "proposer=draft", "proposer.k=3",
          "max_batch_size=2", "max_new_tokens=8", "server.max_queue=1",
          "server.max_prompt_tokens=50", "server.max_tokens=64"]


@pytest.fixture(scope="module")
def service():
    cfg = compose(CONFIG, "serve")
    return Service(Pipeline(cfg), cfg.server)


def refused(service, body, chat=False) -> protocol.BadRequest:
    with pytest.raises(protocol.BadRequest) as info:
        service.admit(body, chat)
    return info.value


def test_admit_names_the_field_and_the_status_of_each_refusal(service):
    wrong = refused(service, {"prompt": "abc", "model": "other"})
    assert (wrong.param, wrong.status, wrong.kind) == ("model", 404, "model_not_found")
    assert refused(service, {"prompt": "a" * 60}).param == "prompt"          # past 50 tokens
    big = refused(service, {"prompt": "abc", "n": 4})                         # 2 + 1 can run
    assert big.param == "n" and "more than this server can hold at once" in big.message
    sampling = refused(service, {"prompt": "abc", "temperature": 0.5})       # a greedy server
    assert sampling.param == "temperature"
    ok = service.admit({"prompt": ["abc", "xy"], "max_tokens": 5}, chat=False)
    assert ok.counts == [3, 2] and ok.budgets == [5, 5] and ok.prompt_tokens == 5


def test_health_and_models_need_no_running_engine(service):
    status, body = service.health()
    assert status == 200 and body["status"] == "ok"
    assert service.models()["data"][0]["id"] == service.model


def test_a_request_runs_through_submit_and_complete():
    cfg = compose(CONFIG, "serve")
    service = Service(Pipeline(cfg), cfg.server)
    service.start()
    try:
        async def run():
            admitted = service.admit({"prompt": "abcab", "max_tokens": 6}, chat=False)
            handles = service.submit(asyncio.get_running_loop(), admitted)
            return await service.complete(admitted, handles, "cmpl-1")
        body = asyncio.run(run())
    finally:
        service.close()
    assert body["id"] == "cmpl-1" and body["choices"][0]["finish_reason"] in ("length", "stop")
    assert body["usage"]["prompt_tokens"] == 5 and body["usage"]["completion_tokens"] <= 6
    with pytest.raises(protocol.BadRequest) as info:                # closed: it drains
        service.submit(None, service.admit({"prompt": "abc"}, chat=False))
    assert info.value.status == 503
