"""OpenAI request bodies in, engine arguments out; results in, OpenAI response bodies out.

Validation is ours, not a schema library's, so every refusal is one OpenAI-style error naming
the field and the fix (HTTP 400): {"error": {"message", "type": "invalid_request_error",
"param", "code"}}. Request fields only ever become add_request() arguments: nothing a client
sends reaches the config (so never a key that imports code).

What a request may set: prompt / messages, max_tokens, stop, seed, n, stream (+
stream_options.include_usage), logprobs (completions: 0-5; chat: logprobs + top_logprobs).
temperature / top_p / top_k / min_p and the repetition / frequency / presence penalties: a
request may set the ones the server runs processors for (`logits=[temperature,top_p,
frequency_penalty,...]` at start; the configured values are the defaults); others only at their
neutral value. response_format ({"type": "json_schema" | "json_object" | "text"}) becomes the
request's own grammar, in place of the server's `constraint=...` for that request.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

MAX_N = 16
PENALTIES = ("repetition_penalty", "frequency_penalty", "presence_penalty")   # greedy servers too
MAX_LOGPROBS = 5
FINISH = {"stop": "stop", "eos": "stop", "length": "length"}


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
    max_tokens = _int(body, "max_completion_tokens" if chat and "max_completion_tokens" in body
                      else "max_tokens", 1, limits.max_tokens, limits.default_max_tokens)
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
    grammar = response_grammar(body.get("response_format"))
    sampling = request_sampling(body, configured)
    return Parsed(prompts, n, max_tokens, _stop(body), seed, logprobs, stream, include_usage,
                  chat, sampling, grammar)


def response_grammar(fmt: Any) -> dict | None:
    """response_format -> the request's grammar (None: free text)."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_schema": {"type": "object"}}
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


def completion_logprobs(tokenizer, token_ids: list[int], logprobs, top) -> dict | None:
    if logprobs is None:
        return None
    pieces = [tokenizer.decode([t]) for t in token_ids]
    offsets, at = [], 0
    for p in pieces:
        offsets.append(at)
        at += len(p)
    return {"tokens": pieces, "token_logprobs": logprobs,
            "top_logprobs": None if top is None else [
                {tokenizer.decode([int(t)]): lp for t, lp in d.items()} for d in top],
            "text_offset": offsets}


def chat_logprobs(tokenizer, token_ids: list[int], logprobs, top) -> dict | None:
    if logprobs is None:
        return None
    content = []
    for i, (t, lp) in enumerate(zip(token_ids, logprobs)):
        alts = top[i] if top else {}
        content.append({"token": tokenizer.decode([t]), "logprob": lp,
                        "top_logprobs": [{"token": tokenizer.decode([int(a)]), "logprob": v}
                                         for a, v in alts.items()]})
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
    out["greedy"] = not any(k in out for k in ("top_p", "top_k", "min_p")) and \
        out.get("temperature", 0) == 0
    return out
