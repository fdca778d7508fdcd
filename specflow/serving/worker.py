"""The engine's round loop in a thread of its own, fed by the HTTP handlers.

Handlers `submit()` a request and read its outputs from an asyncio queue; the worker thread owns
the engine (which is not thread-safe): it admits what was submitted, aborts what was cancelled,
steps, and hands every RequestOutput to its request's queue on the event loop. Submissions beyond
the running slots plus `max_queue` waiting ones are refused (the server answers 429); the
sequences of one HTTP request (prompts x n) are queued all together or not at all. `drain()`
stops admitting new requests and lets those in flight finish; `close()` aborts the rest.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field

from specflow.engine import RequestOutput


class QueueFull(Exception):
    """More requests than running slots plus the waiting queue."""


class Draining(Exception):
    """The server is shutting down and admits nothing new."""


@dataclass
class Handle:
    """One engine request as the HTTP side sees it."""

    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue
    args: dict
    request_id: int | None = None          # set by the worker when the engine accepts it
    done: bool = False
    error: BaseException | None = field(default=None, repr=False)


class EngineWorker:
    def __init__(self, pipe, max_queue: int, max_batch_size: int | None = None):
        self.pipe = pipe
        self.engine = pipe.engine(max_batch_size)
        self.capacity = self.engine.capacity
        self.max_queue = max_queue
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.wake = threading.Event()
        self.lock = threading.Lock()
        self.in_flight = 0                    # submitted and not finished
        self.handles: dict[int, Handle] = {}
        self.draining = False
        self.deadline: float | None = None    # draining: when requests still running are ended
        self.stopped = False
        self.finished: dict[str, int] = {}     # finish_reason -> requests
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.thread = threading.Thread(target=self._run, name="specflow-engine", daemon=True)

    # --- the HTTP side (event loop thread) ---------------------------------------------------

    def start(self) -> None:
        self.thread.start()

    def submit(self, loop: asyncio.AbstractEventLoop, **args) -> Handle:
        """Queue one request (add_request's arguments); raises QueueFull or Draining."""
        return self.submit_many(loop, [args])[0]

    def submit_many(self, loop: asyncio.AbstractEventLoop, requests: list[dict]) -> list[Handle]:
        """Queue the sequences of one HTTP request (add_request's arguments each), all of them or
        none: QueueFull when they do not all fit in the free slots and queue now, Draining while
        shutting down; nothing is queued then, so no row is admitted only to be aborted."""
        with self.lock:
            if self.draining:
                raise Draining()
            if self.in_flight + len(requests) > self.capacity + self.max_queue:
                raise QueueFull(self.in_flight)
            self.in_flight += len(requests)
        handles = [Handle(loop, asyncio.Queue(), args) for args in requests]
        for handle in handles:
            self.inbox.put(("add", handle))
        self.wake.set()
        return handles

    def cancel(self, handle: Handle) -> None:
        """The client went away: abort its request (queued or running) and free its slot."""
        if not handle.done:
            self.inbox.put(("abort", handle))
            self.wake.set()

    @property
    def waiting(self) -> int:
        return max(0, self.in_flight - self.engine.num_running)

    @property
    def running(self) -> int:
        return self.engine.num_running

    def drain(self, grace: float | None = None) -> None:
        """Admit nothing new; requests already submitted run to their end, or for `grace`
        seconds, after which each is ended with an error its client receives (before the HTTP
        server gives up on the connection)."""
        with self.lock:
            self.draining = True
            if grace is not None and self.deadline is None:
                self.deadline = time.monotonic() + grace
        self.wake.set()

    def close(self, timeout: float = 5.0) -> None:
        self.drain()
        self.stopped = True
        self.wake.set()
        self.thread.join(timeout)

    # --- the worker thread -------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self.stopped:
                self._take_inbox()
                if self.deadline is not None and time.monotonic() > self.deadline:
                    self._end_all("the server shut down before this request finished "
                                  "(server.grace_seconds ran out)")
                if engine.has_unfinished():
                    self._step()
                else:
                    self.wake.wait(0.05)
                    self.wake.clear()
        finally:
            for handle in list(self.handles.values()):
                self._finish(handle, RuntimeError("the server stopped before this request ended"))
            engine.close()

    def _take_inbox(self) -> None:
        while True:
            try:
                kind, handle = self.inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                try:
                    rid = self.engine.add_request(**handle.args)
                except Exception as exc:      # noqa: BLE001 - refused: that request alone fails
                    self._finish(handle, exc)
                    continue
                handle.request_id = rid
                self.handles[rid] = handle
                self.prompt_tokens += len(self.engine.request(rid).prompt_ids)
            elif handle.request_id is not None and not handle.done:
                self.engine.abort(handle.request_id)

    def _end_all(self, why: str) -> None:
        for handle in list(self.handles.values()):
            if handle.request_id is not None:
                self.engine.abort(handle.request_id)
            self._finish(handle, RuntimeError(why))
        # the engine reports these aborts at its next step; their handles are gone (skipped)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:      # noqa: BLE001 - the running rows were aborted: tell them
            for rid in [rid for rid, h in self.handles.items() if h.request_id is not None
                        and self.engine.request(rid) is None]:
                self._finish(self.handles[rid], exc)
            return
        for out in outputs:
            handle = self.handles.get(out.request_id)
            if handle is None:
                continue
            self.generation_tokens += len(out.token_ids)
            if out.finished:     # its place is free before its client hears of the end
                self.finished[out.finish_reason] = self.finished.get(out.finish_reason, 0) + 1
                self._finish(handle, None)
            handle.loop.call_soon_threadsafe(handle.outputs.put_nowait, out)

    def _finish(self, handle: Handle, error: BaseException | None) -> None:
        """The request is over: its place counts no more (before its client is told, so a client
        sending its next request at once finds the place free), then the error, if any, goes
        to the client."""
        handle.done = True
        handle.error = error
        if handle.request_id is not None:
            self.handles.pop(handle.request_id, None)
        with self.lock:
            self.in_flight -= 1
        if error is not None:
            handle.loop.call_soon_threadsafe(handle.outputs.put_nowait, error)


async def outputs_of(handle: Handle):
    """The request's RequestOutputs as they come; raises what the worker reported."""
    while True:
        item = await handle.outputs.get()
        if isinstance(item, BaseException):
            raise item
        yield item
        if isinstance(item, RequestOutput) and item.finished:
            return
