"""A request answered as server-sent events: each sequence's text deltas as the engine commits
them (merged across the request's n sequences), its finish chunk, the usage chunk when asked
for, then [DONE]. Whatever still runs is cancelled when the stream ends or the client leaves."""
from __future__ import annotations

import asyncio
import time

from specflow.serving import protocol
from specflow.serving.worker import outputs_of


async def events(service, admitted, handles: list, rid: str):
    """The SSE lines of one request (an async generator of str)."""
    parsed, model, tok = admitted.parsed, service.model, service.pipe.tokenizer
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
                lp = protocol.chat_logprobs(tok, out.token_ids, out.logprobs, out.top_logprobs)
            elif out.logprobs is not None:
                lp = protocol.completion_logprobs(tok, out.token_ids, out.logprobs,
                                                  out.top_logprobs, offsets[i])
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
            use = protocol.usage(admitted.prompt_tokens, results)
            yield protocol.sse({"id": rid, "object": "chat.completion.chunk" if parsed.chat
                                else "text_completion", "created": int(time.time()),
                                "model": model, "choices": [], "usage": use})
        yield protocol.sse("[DONE]")
    finally:                     # finished, or the client went away mid-stream
        for h in handles:
            service.worker.cancel(h)
        for t in tasks:
            t.cancel()
