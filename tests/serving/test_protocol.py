"""Request bodies in, engine arguments out: what a request may set, and one clear error (naming
the field) for what it may not."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from specflow.serving import protocol

LIMITS = protocol.Limits(max_tokens=100, max_prompt_tokens=50)


def parse(body, chat=False, configured=None):
    return protocol.parse(body, chat, LIMITS, configured or {"greedy": True},
                          lambda messages: "|".join(m["content"] for m in messages))


def test_completion_and_chat_bodies_become_engine_arguments():
    p = parse({"prompt": ["a", "b"], "max_tokens": 7, "stop": "\n", "seed": 3, "n": 2,
               "logprobs": 2, "stream": True, "stream_options": {"include_usage": True}})
    assert (p.prompts, p.max_tokens, p.stop, p.seed, p.n, p.logprobs, p.stream,
            p.include_usage) == (["a", "b"], 7, ["\n"], 3, 2, 2, True, True)
    c = parse({"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
               "top_logprobs": 3, "max_completion_tokens": 9}, chat=True)
    assert (c.prompts, c.logprobs, c.max_tokens) == (["hi"], 3, 9)
    assert parse({"prompt": "x"}).max_tokens == LIMITS.default_max_tokens


@pytest.mark.parametrize("body, field", [
    ({"prompt": "x", "max_tokens": 101}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "x", "n": 17}, "n"),
    ({"prompt": "x", "logprobs": 6}, "logprobs"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"prompt": "x", "seed": -1}, "seed"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "top_p": 0.5}, "top_p"),
    ({"prompt": "x", "response_format": {"type": "xml"}}, "response_format"),
    ({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {}}},
     "response_format"),
    ({"prompt": ["a", ""]}, "prompt"),
    ({"prompt": "x", "best_of": 2}, "best_of"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "echo": True, "logprobs": 0}, "echo"),
    ({"prompt": "x", "frobnicate": 1}, "frobnicate"),
    ({"prompt": "x", "logit_bias": {"1": 200}}, "logit_bias"),
    ({"prompt": "x", "top_k": 2.5}, "top_k"),
    ({"prompt": "x", "temperature": float("inf")}, "temperature"),
    ({"prompt": "x\ud800"}, "prompt"),
])
def test_refusals_name_the_field(body, field):
    with pytest.raises(protocol.BadRequest) as info:
        parse(body)
    assert info.value.param == field and info.value.body()["error"]["param"] == field


def test_response_format_becomes_the_request_s_grammar():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = {"prompt": "x", "response_format": {"type": "json_schema",
                                               "json_schema": {"name": "t", "schema": schema}}}
    assert parse(body).grammar == {"json_schema": schema}
    assert parse({"prompt": "x", "response_format": {"type": "json_object"}}).grammar == \
        {"json_schema": {"type": "object"}}
    assert parse({"prompt": "x", "response_format": {"type": "text"}}).grammar is None


def test_chat_needs_text_messages():
    with pytest.raises(protocol.BadRequest, match="messages must be"):
        parse({"messages": [{"role": "user"}]}, chat=True)
    with pytest.raises(protocol.BadRequest, match="top_logprobs needs logprobs=true"):
        parse({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, chat=True)


def test_requests_set_the_sampling_processors_the_server_runs():
    cfg = OmegaConf.create({"logits": {"temperature": {"name": "temperature", "value": 0.7},
                                       "top_p": {"name": "top_p", "p": 0.9}}})
    configured = protocol.configured_sampling(cfg)
    assert configured == {"temperature": 0.7, "top_p": 0.9, "greedy": False}
    p = parse({"prompt": "x", "temperature": 0.3, "top_p": 0.5, "top_k": -1, "min_p": 0},
              configured=configured)
    assert p.sampling == {"temperature": 0.3, "top_p": 0.5}       # neutral top_k, min_p dropped
    assert parse({"prompt": "x"}, configured=configured).sampling is None
    with pytest.raises(protocol.BadRequest, match="top_k=5: this server was started with "
                                                  "temperature=0.7, top_p=0.9, without a top_k"):
        parse({"prompt": "x", "top_k": 5}, configured=configured)
    greedy = protocol.configured_sampling(OmegaConf.create({"logits": {}}))
    assert parse({"prompt": "x", "temperature": 0, "top_p": 1.0}, configured=greedy).sampling \
        is None
    with pytest.raises(protocol.BadRequest, match="started with greedy decoding"):
        parse({"prompt": "x", "temperature": 0.8}, configured=greedy)
    # greedy by default, with a temperature processor: a request may ask for its own temperature
    at_zero = protocol.configured_sampling(OmegaConf.create(
        {"logits": {"temperature": {"name": "temperature", "value": 0},
                    "top_k": {"name": "top_k", "k": 20}}}))
    assert not at_zero["greedy"]
    assert parse({"prompt": "x", "temperature": 0.7, "top_k": 5}, configured=at_zero).sampling \
        == {"temperature": 0.7, "top_k": 5}


def test_prompt_length_limit():
    protocol.check_prompt_length(50, LIMITS, "prompt")
    with pytest.raises(protocol.BadRequest, match="prompt has 51 tokens; this server admits "
                                                  "at most 50"):
        protocol.check_prompt_length(51, LIMITS, "prompt")


def test_echo_logit_bias_and_neutral_fields():
    p = parse({"prompt": "x", "echo": True, "logit_bias": {"3": -100, "7": 2.5}, "best_of": 1,
               "suffix": "", "user": "u"})
    assert p.echo and p.sampling == {"logit_bias": {3: -100.0, 7: 2.5}}
    assert parse({"prompt": "x", "logit_bias": {}}).sampling is None
    c = parse({"messages": [{"role": "user", "content": "x"}], "tools": [],
               "tool_choice": "none", "metadata": {"a": "b"}}, chat=True)
    assert not c.echo
    with pytest.raises(protocol.BadRequest, match="is a field of /v1/completions") as info:
        parse({"messages": [{"role": "user", "content": "x"}], "echo": True}, chat=True)
    assert info.value.param == "echo"


def test_max_tokens_must_fit_in_the_context_with_the_prompt():
    limits = protocol.Limits(max_tokens=100, max_prompt_tokens=50, context=64)
    asked = protocol.parse({"prompt": "x", "max_tokens": 20}, False, limits, {"greedy": True},
                           None)
    assert protocol.completion_budget(asked, 44, limits) == 20
    with pytest.raises(protocol.BadRequest, match=r"maximum context length is 64 tokens\. "
                                                  r"However, you requested 65 tokens \(45 in the "
                                                  r"prompt, 20 in the completion\)") as info:
        protocol.completion_budget(asked, 45, limits)
    assert info.value.param == "max_tokens"
    default = protocol.parse({"prompt": "x"}, False, limits, {"greedy": True}, None)
    assert protocol.completion_budget(default, 10, limits) == 16
    assert protocol.completion_budget(default, 60, limits) == 4      # cut to fit, not refused
