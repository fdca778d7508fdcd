"""OpenAI request bodies in, engine arguments out; results in, OpenAI response bodies out.

Validation is ours, not a schema library's, so every refusal is one OpenAI-style error naming
the field and the fix (HTTP 400): {"error": {"message", "type": "invalid_request_error",
"param", "code"}}. Request fields only ever become add_request() arguments: nothing a client
sends reaches the config (so never a key that imports code).

What a request may set: prompt / messages, max_tokens, stop, seed, n, stream (+
stream_options.include_usage), logprobs (completions: 0-5; chat: logprobs + top_logprobs), echo
(completions: the prompt before the completion; not with logprobs, whose prompt part this server
does not compute), logit_bias (token id -> bias in [-100, 100]).
temperature / top_p / top_k / min_p and the repetition / frequency / presence penalties: a
request may set the ones the server runs processors for (`logits=[temperature,top_p,
frequency_penalty,...]` at start; the configured values are the defaults); others only at their
neutral value. response_format ({"type": "json_schema" | "json_object" | "text"}) becomes the
request's own grammar, in place of the server's `constraint=...` for that request.

Every other field is refused (400 naming it) unless it cannot change the result (`user`,
`metadata`, `store`, ...) or has its neutral value (`best_of` 1 or n, `suffix` empty, `tools`
empty, `tool_choice` "none", ...), so a field that would change the output is never silently
ignored; an unknown field is refused, as OpenAI refuses it.
"""
from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from specflow.request import LOGPROB_FLOOR

MAX_N = 16
PENALTIES = ("repetition_penalty", "frequency_penalty", "presence_penalty")   # greedy servers too
MAX_LOGPROBS = 5
FINISH = {"stop": "stop", "eos": "stop", "length": "length"}

# the fields each endpoint reads
SAMPLING = ("temperature", "top_p", "top_k", "min_p", *PENALTIES)
COMMON = {"model", "n", "seed", "stop", "stream", "stream_options", "max_tokens", "logprobs",
          "logit_bias", "response_format", *SAMPLING}
READ = {False: COMMON | {"prompt", "echo", "best_of", "suffix"},
        True: COMMON | {"messages", "max_completion_tokens", "top_logprobs"}}
# OpenAI fields that cannot change the output: accepted and ignored
HARMLESS = {"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
            "prompt_cache_retention", "parallel_tool_calls", "prediction"}
# OpenAI chat fields that would change the output, accepted only at their neutral value
NEUTRAL_CHAT = {"tools": "leave tools out: this server does not call tools",
                "functions": "leave functions out: this server does not call functions",
                "tool_choice": "use \"none\" or leave it out: this server does not call tools",
                "function_call": "use \"none\" or leave it out: this server does not call "
                                 "functions",
                "audio": "leave it out: this server answers in text only",
                "modalities": "use [\"text\"] or leave it out: this server answers in text only",
                "reasoning_effort": "leave it out: the served model does not reason in a "
                                    "separate channel",
                "verbosity": "leave it out: this server has no verbosity setting",
                "web_search_options": "leave it out: this server does not search the web"}


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": None}}


@dataclass
class Limits:
    max_tokens: int              # the most a request may ask for
    max_prompt_tokens: int       # the longest prompt admitted (tokens)
    default_max_tokens: int = 16
    context: int | None = None   # the model's context (prompt + completion), None: unbounded
    vocab_size: int | None = None   # token ids (logit_bias keys) are below it


@dataclass
class Parsed:
    prompts: list[str]           # one per prompt (completions may send a list)
    n: int
    max_tokens: int
    stop: list[str] | None
    seed: int | None
    logprobs: int | None         # engine logprobs: None off, 0 chosen tokens, k also top k
    stream: bool
    include_usage: bool
    chat: bool
    sampling: dict | None = None  # the request's own values of the server's sampling processors
    grammar: dict | None = None   # response_format as a grammar: {"json_schema": schema}
    echo: bool = False            # completions: the prompt comes back before the completion
    max_tokens_field: str | None = None   # the field that set max_tokens (None: the default)


def _int(body: dict, name: str, lo: int, hi: int | None, default=None) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{name}={value!r} must be a whole number", name)
    if value < lo or (hi is not None and value > hi):
        bound = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
        raise BadRequest(f"{name}={value} must be {bound}", name)
    return value


def _is_neutral(name: str, value) -> bool:
    if value is None:
        return True
    if name in ("tools", "functions"):
        return value == []
    if name in ("tool_choice", "function_call"):
        return value == "none"
    if name == "modalities":
        return value == ["text"]
    return False


def check_fields(body: dict, chat: bool) -> None:
    """Refuse what this server would otherwise ignore: a field it does not read that could change
    the output (tools, audio, ...) unless it has its neutral value, and a field this server does
    not know (`ignore_eos`, a typo; OpenAI refuses unrecognized arguments too). Harmless fields
    (user, metadata, ...) pass."""
    for name, value in body.items():
        if name in READ[chat] or name in HARMLESS:
            continue
        endpoint = "/v1/chat/completions" if chat else "/v1/completions"
        if chat and name in NEUTRAL_CHAT:
            if _is_neutral(name, value):
                continue
            raise BadRequest(f"{name}={json.dumps(value)[:80]} is not supported by this server; "
                             f"{NEUTRAL_CHAT[name]}", name)
        other = READ[not chat] - READ[chat]
        hint = f" ({name} is a field of {'/v1/completions' if chat else '/v1/chat/completions'})" \
            if name in other else ""
        raise BadRequest(f"unrecognized request argument supplied to {endpoint}: {name}{hint}; "
                         f"remove it", name)


def _lone_surrogate(value) -> bool:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, list):
        return any(_lone_surrogate(v) for v in value)
    if isinstance(value, dict):
        return any(_lone_surrogate(k) or _lone_surrogate(v) for k, v in value.items())
    return False


def check_unicode(body: dict) -> None:
    """A JSON string escape may spell a lone surrogate ("\\ud800"), which is no Unicode text: no
    tokenizer takes it and no response could carry it back."""
    for name, value in body.items():
        if _lone_surrogate(name) or _lone_surrogate(value):
            raise BadRequest(f"{name.encode('utf-8', 'backslashreplace').decode()} holds a lone "
                             f"surrogate (a \\ud800-\\udfff escape without its pair), which is "
                             f"not valid Unicode text; send UTF-8 text", name)


def _logit_bias(body: dict, vocab_size: int | None) -> dict | None:
    """OpenAI's logit_bias: {"token id": bias in [-100, 100]} -> {int: float} (None if empty)."""
    from specflow.errors import ConfigError
    from specflow.stages.request_settings import check_logit_bias

    bias = body.get("logit_bias")
    if bias is None:
        return None
    try:        # the check generate(sampling={"logit_bias": ...}) makes
        return check_logit_bias(bias, 0, vocab_size, where="logit_bias") or None
    except ConfigError as exc:
        raise BadRequest(str(exc), "logit_bias") from None


def _completion_only(body: dict) -> bool:
    """best_of and suffix at their neutral values (refused otherwise); -> echo."""
    n = body.get("n", 1)
    best_of = body.get("best_of")
    if best_of is not None and (isinstance(best_of, bool) or best_of not in (1, n)):
        raise BadRequest(f"best_of={best_of!r} is not supported: this server does not generate "
                         f"extra completions to return the best of; leave best_of out (or equal "
                         f"to n)", "best_of")
    suffix = body.get("suffix")
    if suffix not in (None, ""):
        raise BadRequest("suffix is not supported: this server does not insert text before a "
                         "suffix; leave suffix out (or put the text in the prompt)", "suffix")
    echo = body.get("echo", False)
    if echo is None:
        echo = False
    if not isinstance(echo, bool):
        raise BadRequest("echo must be true or false", "echo")
    return echo


def _stop(body: dict) -> list[str] | None:
    stop = body.get("stop")
    if stop is None:
        return None
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) \
            or len(stop) > 4:
        raise BadRequest("stop must be a non-empty string or a list of up to 4 non-empty "
                         "strings", "stop")
    return stop


def request_sampling(body: dict, configured: dict) -> dict | None:
    """temperature / top_p / top_k / min_p / the penalties of a request -> its own settings.

    A setting the server runs a processor for (`logits=[temperature,top_p,...]` at start) may be
    set per request; one it does not run may only be left out or given its neutral value
    (temperature 0 when the server decodes greedily, 1 when it samples without one; top_p 1;
    top_k 0 or -1; min_p 0; repetition_penalty 1; frequency and presence penalties 0). A greedy
    server takes only the penalties it runs (they change the argmax)."""
    greedy = bool(configured.get("greedy"))
    neutral = {"temperature": 0 if greedy else 1.0, "top_p": 1.0, "top_k": (0, -1), "min_p": 0.0,
               "repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}
    own = {}
    for name, default in neutral.items():
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise BadRequest(f"{name}={value!r} must be a number", name)
        if not math.isfinite(value):
            raise BadRequest(f"{name}={value} must be a finite number", name)
        if name == "top_k" and value != int(value):
            raise BadRequest(f"top_k={value} must be a whole number", name)
        if name in configured and (not greedy or name in PENALTIES):
            own[name] = value
            continue
        if value in default if isinstance(default, tuple) else value == default:
            continue
        now = "greedy decoding" if greedy else ", ".join(
            f"{k}={v}" for k, v in configured.items() if k != "greedy")
        raise BadRequest(f"{name}={value}: this server was started with {now}, without a {name} "
                         f"processor, so a request cannot set it; start the server with the "
                         f"processors requests may set (e.g. specflow serve "
                         f"logits=[temperature,top_p,top_k] ...)", name)
    return own or None


def parse(body: Any, chat: bool, limits: Limits, configured: dict, chat_prompt) -> Parsed:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    check_unicode(body)
    check_fields(body, chat)
    echo = False if chat else _completion_only(body)
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str) for m in messages):
            raise BadRequest("messages must be a non-empty list of {role, content} objects with "
                             "text content", "messages")
        prompts = [chat_prompt(messages)]
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            prompts = list(prompt)
        else:
            raise BadRequest("prompt must be a string or a non-empty list of strings", "prompt")
        if any(not p for p in prompts):
            raise BadRequest("prompt is empty; give at least one character", "prompt")
    field = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = _int(body, field, 1, limits.max_tokens, limits.default_max_tokens)
    n = _int(body, "n", 1, MAX_N, 1)
    seed = _int(body, "seed", 0, 2 ** 63 - 1)
    if chat:
        want = body.get("logprobs")
        if want not in (None, True, False):
            raise BadRequest("logprobs must be true or false", "logprobs")
        top = _int(body, "top_logprobs", 0, MAX_LOGPROBS)
        logprobs = (top or 0) if want else None
        if top is not None and not want:
            raise BadRequest("top_logprobs needs logprobs=true", "top_logprobs")
    else:
        logprobs = _int(body, "logprobs", 0, MAX_LOGPROBS)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream must be true or false", "stream")
    options = body.get("stream_options") or {}
    include_usage = bool(isinstance(options, dict) and options.get("include_usage"))
    if echo and logprobs is not None:
        raise BadRequest("echo with logprobs would return the prompt's logprobs too, which this "
                         "server does not compute; ask for echo or for logprobs, not both", "echo")
    grammar = response_grammar(body.get("response_format"))
    sampling = request_sampling(body, configured)
    bias = _logit_bias(body, limits.vocab_size)
    if bias is not None:
        sampling = {**(sampling or {}), "logit_bias": bias}
    return Parsed(prompts, n, max_tokens, _stop(body), seed, logprobs, stream, include_usage,
                  chat, sampling, grammar, echo,
                  field if body.get(field) is not None else None)


JSON_OBJECT = {"json_schema": {"type": "object"}}    # response_format json_object's grammar


def response_grammar(fmt: Any) -> dict | None:
    """response_format -> the request's grammar (None: free text)."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_schema": {"type": "object"}}      # JSON_OBJECT, a request's own copy
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise BadRequest("response_format.json_schema.schema must be a JSON Schema object",
                             "response_format")
        return {"json_schema": schema}
    raise BadRequest("response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                     "{\"type\": \"json_schema\", \"json_schema\": {\"schema\": {...}}}",
                     "response_format")


def check_prompt_length(tokens: int, limits: Limits, field: str) -> None:
    if tokens > limits.max_prompt_tokens:
        raise BadRequest(f"{field} has {tokens} tokens; this server admits at most "
                         f"{limits.max_prompt_tokens}; shorten it", field)


def completion_budget(parsed: Parsed, tokens: int, limits: Limits) -> int:
    """max_tokens for a prompt of `tokens` tokens: as asked, which must fit in the model's
    context with the prompt (a 400 as vLLM's otherwise); the server's default when the request
    gave none, cut to what fits."""
    if limits.context is None or tokens + parsed.max_tokens <= limits.context:
        return parsed.max_tokens
    if parsed.max_tokens_field is None:
        return limits.context - tokens
    where = "messages" if parsed.chat else "prompt"
    raise BadRequest(f"This model's maximum context length is {limits.context} tokens. However, "
                     f"you requested {tokens + parsed.max_tokens} tokens ({tokens} in the "
                     f"{where}, {parsed.max_tokens} in the completion). Please reduce the length "
                     f"of the {where} or {parsed.max_tokens_field} (at most "
                     f"{limits.context - tokens} here).", parsed.max_tokens_field)


# --- responses ---------------------------------------------------------------------------------

def new_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"


def speculation(stats: dict) -> dict:
    keys = ("num_rounds", "num_target_passes", "num_draft_tokens", "num_accepted_tokens",
            "alpha", "mean_acceptance_length")
    return {k: stats[k] for k in keys if k in stats}


def usage(prompt_tokens: int, results: list) -> dict:
    completion = sum(len(r.token_ids) for r in results)
    spec = [speculation(r.stats) for r in results]
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
           "total_tokens": prompt_tokens + completion}
    out["speculation"] = spec[0] if len(spec) == 1 else spec
    return out


def _finite(value: float) -> float:
    """A logprob JSON can carry: -inf (and NaN, which no committed token has) as the floor."""
    return value if value >= LOGPROB_FLOOR else LOGPROB_FLOOR


def _alternatives(top: dict) -> list[tuple[int, float]]:
    """A position's top alternatives with a chance of being chosen (as OpenAI, which never lists
    a token of probability 0: a grammar or a processor may leave fewer than asked for)."""
    return [(int(t), v) for t, v in top.items() if v > -math.inf]


def completion_logprobs(tokenizer, token_ids: list[int], logprobs, top,
                        start: int = 0) -> dict | None:
    """The completions `logprobs` object of these tokens; `start`: the text offset of the first
    (a stream's earlier chunks, the echoed prompt), so offsets index the whole response text."""
    if logprobs is None:
        return None
    pieces = [tokenizer.decode([t]) for t in token_ids]
    offsets, at = [], start
    for p in pieces:
        offsets.append(at)
        at += len(p)
    return {"tokens": pieces, "token_logprobs": [_finite(v) for v in logprobs],
            "top_logprobs": None if top is None else [
                {tokenizer.decode([t]): v for t, v in _alternatives(d)} for d in top],
            "text_offset": offsets}


def text_end(logprobs: dict | None, start: int) -> int:
    """Where the text of a completions `logprobs` object ends (the next chunk's start)."""
    if not logprobs or not logprobs["tokens"]:
        return start
    return logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])


def chat_logprobs(tokenizer, token_ids: list[int], logprobs, top) -> dict | None:
    if logprobs is None:
        return None
    content = []
    for i, (t, lp) in enumerate(zip(token_ids, logprobs)):
        alts = _alternatives(top[i]) if top else []
        content.append({"token": tokenizer.decode([t]), "logprob": _finite(lp),
                        "top_logprobs": [{"token": tokenizer.decode([a]), "logprob": v}
                                         for a, v in alts]})
    return {"content": content}


def choice(parsed: Parsed, index: int, text: str, finish: str | None, logprobs) -> dict:
    if parsed.chat:
        return {"index": index, "message": {"role": "assistant", "content": text},
                "finish_reason": finish, "logprobs": logprobs}
    return {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}


def body(parsed: Parsed, rid: str, model: str, choices: list[dict], use: dict | None) -> dict:
    out = {"id": rid, "object": "chat.completion" if parsed.chat else "text_completion",
           "created": int(time.time()), "model": model, "choices": choices}
    if use is not None:
        out["usage"] = use
    return out


def chunk(parsed: Parsed, rid: str, model: str, index: int, text: str | None,
          finish: str | None, logprobs=None, first: bool = False) -> dict:
    if parsed.chat:
        delta = {} if text is None else {"content": text}
        if first:
            delta["role"] = "assistant"
        ch = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        kind = "chat.completion.chunk"
    else:
        ch = {"index": index, "text": text or "", "finish_reason": finish, "logprobs": logprobs}
        kind = "text_completion"
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model,
            "choices": [ch]}


def sse(data: dict | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


def configured_sampling(cfg) -> dict:
    """The sampling settings the server's pipeline applies to every request."""
    logits = cfg.get("logits") or {}
    out: dict[str, Any] = {}
    for node in logits.values():
        name = node.get("name")
        if name == "temperature":
            out["temperature"] = float(node.get("value", 1.0))
        elif name == "top_p":
            out["top_p"] = float(node.get("p"))
        elif name == "top_k":
            out["top_k"] = int(node.get("k"))
        elif name == "min_p":
            out["min_p"] = float(node.get("p"))
        elif name == "repetition_penalty":
            out[name] = float(node.get("penalty"))
        elif name in ("frequency_penalty", "presence_penalty"):
            out[name] = float(node.get("value"))
    # greedy: no request can sample (a temperature processor, even at 0, lets one ask for its own)
    out["greedy"] = not any(k in out for k in ("temperature", "top_p", "top_k", "min_p"))
    return out
