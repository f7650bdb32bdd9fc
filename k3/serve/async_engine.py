"""Runs an `Engine` on a background thread and streams its outputs to asyncio callers.

All engine state is touched only by the engine thread: callers post commands (add, abort) to a
queue; outputs come back through `loop.call_soon_threadsafe` into one asyncio queue per request.
A caller that stops iterating (client disconnect, task cancellation) aborts its request, which
frees the request's cache.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from typing import Any, Sequence

from k3.serve.engine import Engine, RequestOutput
from k3.serve.sampling import SamplingParams

log = logging.getLogger("k3.serve")


class Overloaded(RuntimeError):
    """Too many requests are waiting; the server answers 503."""


class AsyncEngine:
    def __init__(self, engine: Engine, *, idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self._idle = idle_wait_s
        self._pending_adds = 0
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.aborted = 0

    # ---- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="k3-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- requests ----------------------------------------------------------------------------------
    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, *, request_id: str | None = None,
               checkpoint_positions: Sequence[int] = (), media: Sequence[Any] | None = None,
               constraint: Any = None) -> "RequestStream":
        """Queue a request (Overloaded when too many are waiting); iterate the stream for outputs.
        media: image/video tensors for the prompt's media pads (encoded on the engine thread).
        constraint: factory of a fresh grammar constraint (k3.serve.structured), or None.
        Must be called on the event loop that will consume the stream."""
        return self.submit_n(prompt_ids, params, 1, request_id=request_id, checkpoint_positions=checkpoint_positions,
                             media=media, constraint=constraint)[0]

    def submit_n(self, prompt_ids: Sequence[int], params: SamplingParams, n: int, *, request_id: str | None = None,
                 checkpoint_positions: Sequence[int] = (), media: Sequence[Any] | None = None,
                 constraint: Any = None) -> list["RequestStream"]:
        """`n` samples of one prompt (the prompt is computed once; `Engine.add_request` fork_ids): one
        stream per sample, ids `rid`, `rid-1`, ... `rid-(n-1)`."""
        with self._lock:
            if self.engine.num_waiting + self._pending_adds >= self.engine.config.max_waiting:
                raise Overloaded(f"{self.engine.config.max_waiting} requests are already waiting")
            self._pending_adds += 1
        rid = request_id or uuid.uuid4().hex
        rids = [rid] + [f"{rid}-{k}" for k in range(1, n)]
        loop = asyncio.get_running_loop()
        streams = []
        for r in rids:
            q: asyncio.Queue = asyncio.Queue()
            self._streams[r] = (loop, q)
            streams.append(RequestStream(self, r, q))
        self._cmds.put(("add", rids, list(prompt_ids), params, tuple(checkpoint_positions), media, constraint))
        self._wake.set()
        return streams

    def _abort(self, rid: str) -> None:
        self._streams.pop(rid, None)
        self._cmds.put(("abort", rid))
        self._wake.set()

    # ---- engine thread -----------------------------------------------------------------------------
    def _deliver(self, rid: str, item: object) -> None:
        last = isinstance(item, BaseException) or getattr(item, "finished", False)
        # the last item unregisters the stream here too: a consumer that never iterates must not leak
        entry = self._streams.pop(rid, None) if last else self._streams.get(rid)
        if entry is None:
            return
        loop, q = entry
        try:
            loop.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed
            pass

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, rids, ids, params, cps, media, constraint = cmd
                with self._lock:
                    self._pending_adds -= 1
                if not any(r in self._streams for r in rids):
                    continue  # the caller already left
                try:
                    self.engine.add_request(ids, params, request_id=rids[0], checkpoint_positions=cps, media=media,
                                            fork_ids=rids[1:], constraint=constraint)
                except (ValueError, KeyError) as e:
                    for r in rids:
                        self._deliver(r, ValueError(str(e)))
                    continue
                for r in rids:  # a stream closed before its request existed
                    if r not in self._streams and self.engine.abort(r):
                        self.aborted += 1
            elif cmd[0] == "abort":
                if self.engine.abort(cmd[1]):
                    self.aborted += 1

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._drain_commands()
                if not self.engine.has_unfinished():
                    self._wake.wait(self._idle)
                    self._wake.clear()
                    continue
                for out in self.engine.step():
                    self._deliver(out.request_id, out)
            except Exception as e:  # keep serving: fail what is in flight, drop its state
                log.exception("engine step failed")
                for rid in list(self.engine.requests):
                    self.engine.abort(rid)
                    self._deliver(rid, RuntimeError(f"engine failure: {type(e).__name__}: {e}"))


class RequestStream:
    """Async iterator over one request's outputs; `close()` aborts it unless it already finished."""

    def __init__(self, owner: AsyncEngine, request_id: str, q: asyncio.Queue) -> None:
        self.owner, self.request_id, self._q = owner, request_id, q
        self.done = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.done:
            raise StopAsyncIteration
        item = await self._q.get()
        if item is None:  # closed while waiting
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.done = True
            self.owner._streams.pop(self.request_id, None)
            raise item
        if item.finished:
            self.done = True
            self.owner._streams.pop(self.request_id, None)
        return item

    def close(self) -> None:
        if not self.done:
            self.done = True
            self.owner._abort(self.request_id)
            self._q.put_nowait(None)  # wake a consumer blocked in __anext__
