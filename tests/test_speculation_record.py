"""No silent fallbacks: when a request runs without drafts, its own record says so and why."""
from __future__ import annotations

import json

import pytest


@pytest.mark.parametrize("overrides,state,reason", [
    (["proposer=none"], "off", "proposer=none"),
    (["proposer=draft", "policy.k=0"], "off", "policy"),
    (["proposer=draft"], "on", None),
])
def test_each_request_record_says_whether_and_why(make_pipeline, overrides, state, reason):
    pipe = make_pipeline(*overrides)
    for r in pipe.generate(["abc", "de"], max_new_tokens=4 * 5):
        assert r.stats["speculation"] == state, r.stats
        assert r.stats["speculation_off_reason"] == reason
        json.dumps(r.to_json())             # the record written to requests.jsonl carries it


def test_a_proposer_with_nothing_to_propose_is_recorded(make_pipeline):
    pipe = make_pipeline("proposer=ngram", "proposer.k=3")
    out = pipe.generate(["abcdefgh"], max_new_tokens=6)[0]
    rounds = out.stats["rounds_without_drafts"]
    assert rounds.get("no proposal", 0) > 0 and out.stats["speculation"] in ("partly", "off")
    assert sum(rounds.values()) == out.stats["num_rounds"] - out.stats["num_drafts"]


def test_the_length_cap_is_recorded(make_pipeline):
    out = make_pipeline("proposer=draft", "proposer.k=4").generate(["ab"], max_new_tokens=1)[0]
    assert out.stats["rounds_without_drafts"] == {"length cap": 1}
    assert out.stats["speculation"] == "off" and out.stats["speculation_off_reason"] == "length cap"
