"""``AsyncLLMEngine``: an ``LLMEngine`` driven by one background thread, for asyncio.

This file owns the engine thread and everything that crosses into it:

* one dedicated thread runs ``LLMEngine.step()`` back to back while there is
  work and sleeps on a condition variable when there is none (no polling);
* the event loop never touches the ``LLMEngine``: adds, aborts and calls go
  into a lock-protected inbox that the engine thread applies between steps;
* each request's ``RequestOutput`` deltas reach its ``RequestStream`` (an
  async iterator over an ``asyncio.Queue``) via ``loop.call_soon_threadsafe``,
  one call per event loop per step (a multi-step call's, as soon as they are
  made, while the device runs the next call);
* a step that fails inside the engine fails only its own requests (the
  engine returns them with ``error`` set; their streams get
  ``RequestFailedError``); anything that escapes ``step()`` fails every
  request in flight; either way the thread keeps serving;
* metrics are updated after each step (``kvpage.engine.metrics``);
* ``shutdown`` stops accepting, lets running requests finish within a grace
  period, aborts the rest and joins the thread.

    engine = AsyncLLMEngine(LLMEngine.from_config(config))
    stream = await engine.add_request("r1", "Hello", SamplingParams(max_tokens=8))
    async for delta in stream: ...
    engine.shutdown(grace_seconds=10)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvpage.engine.config import EngineConfig
from kvpage.engine.intake import PromptType
from kvpage.engine.llm_engine import LLMEngine
from kvpage.engine.metrics import EngineMetrics, cache_config_info
from kvpage.engine.request_stream import (
    EngineClosedError,
    RequestFailedError,
    RequestStream,
    call_in_loop,
    put_all,
    settle_all,
)
from kvpage.lora.request import LoRARequest
from kvpage.outputs import RequestOutput
from kvpage.sampling.params import SamplingParams
from kvpage.system.gc_heap import freeze_startup_heap, release_startup_heap

__all__ = ["AsyncLLMEngine", "EngineClosedError", "RequestFailedError", "RequestStream"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_IDLE_BACKOFF_S = 0.005
"""Wait after a step that ran no plan while requests exist (e.g. none fits yet)."""


@dataclass(slots=True)
class _Add:
    stream: RequestStream
    prompt: PromptType
    params: SamplingParams | None
    priority: int
    cache_salt: str | None
    arrival_time: float
    accepted: asyncio.Future[None]
    final_only: bool = False
    lora_request: LoRARequest | None = None


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Call:
    fn: Callable[[LLMEngine], Any]
    future: concurrent.futures.Future[Any] = field(default_factory=concurrent.futures.Future)


class AsyncLLMEngine:
    """Serve an ``LLMEngine`` to asyncio code from one background thread.

    Args:
        engine: the engine to own; after ``start`` only the engine thread uses it
            (use ``submit`` to run code on it between steps).
        metrics: where to record metrics; default a new ``EngineMetrics``.
        model_name: the ``model_name`` label of the default metrics.
        log_stats: write the periodic stats log line (default metrics only).
        metrics_prefix: "kvpage" or "vllm", the name prefix of the default
            metrics' series ("vllm": vLLM's dashboards work unchanged).
        start: start the engine thread now.
    """

    def __init__(
        self,
        engine: LLMEngine,
        *,
        metrics: EngineMetrics | None = None,
        model_name: str = "kvpage",
        log_stats: bool = True,
        start: bool = True,
        metrics_prefix: str = "kvpage",
    ) -> None:
        self.engine = engine
        self.metrics = metrics if metrics is not None else EngineMetrics(
            model_name, log_interval_s=5.0 if log_stats else None, prefix=metrics_prefix,
            max_model_len=engine.max_model_len, cache_config=cache_config_info(engine))
        self.metrics.track_pending(engine.step_executables_pending)
        self._cond = threading.Condition()
        self._inbox: list[_Add | _Abort | _Call] = []
        self._accepting = True
        self._stopping = False
        self._deadline = 0.0
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._thread = threading.Thread(target=self._run, name="kvpage-engine", daemon=True)
        self._started = False
        self._closed = False  # the thread has stopped taking work from the inbox
        self.error: BaseException | None = None
        """Set if the engine thread itself crashed (not a failed step)."""
        self._escaped_failures = 0
        engine.set_overlapped_output_sink(self._deliver_early)
        if start:
            self.start()

    @classmethod
    def from_config(cls, config: EngineConfig, **kwargs: Any) -> AsyncLLMEngine:
        """Load the model named by ``config.model`` and start serving it."""
        return cls(LLMEngine.from_config(config), **kwargs)

    # ---- properties -----------------------------------------------------

    @property
    def num_failed_steps(self) -> int:
        """Steps that failed: handled inside the engine, or escaping it."""
        return self._escaped_failures + int(self.engine.counters.get("failed_steps", 0))

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def max_logprobs(self) -> int:
        """The most logprobs (and top logprobs) a request may ask for."""
        return self.engine.config.max_logprobs

    @property
    def is_running(self) -> bool:
        """The engine thread is alive and has not crashed."""
        return self._thread.is_alive() and self.error is None

    @property
    def accepting(self) -> bool:
        return self._accepting and self.error is None

    # ---- control (any thread) -------------------------------------------

    def start(self) -> None:
        if not self._started:
            self._started = True
            # Full GCs stay off the step loop while the engine thread runs; the thread
            # releases the hold when it ends (kvpage.system.gc_heap).
            freeze_startup_heap()
            self._thread.start()

    async def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        *,
        final_only: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Queue a request (under ``lora_request``'s adapter, if given); returns its
        stream of ``RequestOutput`` deltas
        once the engine thread has accepted it. With ``final_only`` the stream
        yields one output, the finished request (whole texts and token ids,
        assembled by the engine's output streams).

        Raises what ``LLMEngine.add_request`` raises (``ValueError`` for an
        invalid request, ``QueueFullError`` when the waiting queue is full) and
        ``EngineClosedError`` when shutting down. Cancelling the call aborts
        the request.
        """
        if params is not None and params.structured_outputs is not None:
            # Compile off the event loop and the engine thread (bounded by the
            # compiler's timeout); the engine's add_request then finds it cached.
            compiler = self.engine.grammar_compiler
            await asyncio.to_thread(compiler.compile, params.structured_outputs)
        loop = asyncio.get_running_loop()
        stream = RequestStream(self, request_id, loop)
        op = _Add(stream, prompt, params, priority, cache_salt, time.monotonic(),
                  loop.create_future(), final_only, lora_request)
        with self._cond:
            if not self.accepting:
                raise EngineClosedError("the engine is shutting down; no new requests")
            self._inbox.append(op)
            self._cond.notify()
        try:
            await op.accepted
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return stream

    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """``add_request`` and iterate; leaving the loop early aborts the request."""
        stream = await self.add_request(request_id or uuid.uuid4().hex, prompt, params,
                                        priority, cache_salt)
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe; unknown or finished ids are ignored).
        Its final output, finish reason "abort", ends its stream."""
        with self._cond:
            if not self._closed:
                self._inbox.append(_Abort(request_id))
                self._cond.notify()

    def abort_all(self) -> None:
        """Abort every request in flight (thread-safe); their streams end
        with finish reason "abort"."""
        self.submit(lambda _: self._abort(self._ids_in_flight()))

    def submit(self, fn: Callable[[LLMEngine], T]) -> concurrent.futures.Future[T]:
        """Run ``fn(engine)`` on the engine thread between steps; e.g.
        ``engine.submit(LLMEngine.get_stats).result()``. From asyncio, await
        ``asyncio.wrap_future(...)``."""
        call = _Call(fn)
        with self._cond:
            if self._closed:
                call.future.set_exception(EngineClosedError("the engine thread has stopped"))
                return call.future
            self._inbox.append(call)
            self._cond.notify()
        return call.future

    def stop_accepting(self) -> None:
        """Refuse new requests from now on (``EngineClosedError``); running
        ones go on. The first stage of a graceful shutdown."""
        with self._cond:
            self._accepting = False

    def shutdown(self, grace_seconds: float = 30.0) -> None:
        """Stop accepting, let running requests finish for up to
        ``grace_seconds``, abort the rest and join the engine thread."""
        with self._cond:
            self._accepting = False
            if not self._stopping:
                self._stopping = True
                self._deadline = time.monotonic() + max(0.0, grace_seconds)
            self._cond.notify_all()
        if not self._started:
            self._fail_leftovers(EngineClosedError("the engine was shut down"))
            return
        if threading.current_thread() is self._thread:
            return
        self._thread.join(max(0.0, grace_seconds) + 60.0)
        if self._thread.is_alive():
            logger.error("the engine thread did not stop within the grace period (a step hung?)")

    # ---- the engine thread ----------------------------------------------

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # a bug here must not leave clients waiting
            logger.exception("the engine thread crashed")
            self.error = exc
            self._fail_leftovers(EngineClosedError(f"the engine thread crashed: {exc!r}"))
            raise
        else:
            self._fail_leftovers(EngineClosedError("the engine was shut down"))
        finally:
            events = getattr(self.engine, "kv_events", None)
            if events is not None:  # the events port is free again
                events.close()
            release_startup_heap()

    def _serve(self) -> None:
        engine = self.engine
        while True:
            with self._cond:
                while not (self._inbox or self._stopping or engine.has_unfinished_requests()):
                    self._cond.wait()
                ops, self._inbox = self._inbox, []
                stopping, deadline = self._stopping, self._deadline
            self._apply(ops)
            if stopping:
                if not engine.has_unfinished_requests():
                    return
                if time.monotonic() >= deadline:
                    remaining = self._ids_in_flight()
                    logger.warning("shutdown grace period over: aborting %d request(s)",
                                   len(remaining))
                    self._abort(remaining)
                    return
            if engine.has_unfinished_requests():
                self._step()

    def _apply(self, ops: Iterable[_Add | _Abort | _Call]) -> None:
        # Acceptances go to each event loop in one call, as step outputs do.
        settled: dict[asyncio.AbstractEventLoop, list[Any]] = {}
        try:
            for op in ops:
                if isinstance(op, _Add):
                    error = self._apply_add(op)
                    settled.setdefault(op.stream._loop, []).append((op.accepted, error))
                elif isinstance(op, _Abort):
                    self._abort([op.request_id])
                else:
                    try:
                        result = op.fn(self.engine)
                    except BaseException as exc:
                        op.future.set_exception(exc)
                    else:
                        op.future.set_result(result)
        finally:
            for loop, items in settled.items():
                call_in_loop(loop, settle_all, items)

    def _apply_add(self, op: _Add) -> Exception | None:
        """Add one request to the engine; returns why it was refused, if it was."""
        stream = op.stream
        try:
            self.engine.add_request(
                stream.request_id, op.prompt, op.params, op.priority, op.cache_salt,
                delta=not op.final_only, final_only=op.final_only,
                arrival_time=op.arrival_time,
                # only when set: engines without LoRA (test doubles) take no such argument
                **({"lora_request": op.lora_request} if op.lora_request is not None else {}),
            )
        except Exception as exc:
            return exc
        self._streams[stream.request_id] = stream
        params = op.params
        try:
            self.metrics.on_add(stream.request_id, params.n if params else 1,
                                params.max_tokens if params else None)
        except Exception:  # metrics must never stop the engine
            logger.exception("updating metrics failed")
        return None

    def _abort(self, request_ids: list[str]) -> None:
        if not request_ids:
            return
        try:
            outputs = self.engine.abort_request(request_ids)
        except Exception:
            logger.exception("abort_request(%s) failed", request_ids)
            outputs = []
        self._deliver(outputs)
        self._observe(outputs=outputs)

    def _step(self) -> None:
        steps = self.engine.counters["steps"]
        try:
            outputs = self.engine.step()
        except Exception as exc:
            self._fail_step(exc)
            return
        self._deliver(outputs)
        ran = self.engine.counters["steps"] != steps
        self._observe(outputs=outputs, ran=ran, log=True)
        if not ran and not outputs:
            with self._cond:  # nothing fits yet: don't spin, wake on new work
                if not self._inbox:
                    self._cond.wait(_IDLE_BACKOFF_S)

    def _deliver_early(self, outputs: list[RequestOutput]) -> None:
        """The last device call's outputs, made while the engine waits for the next
        call (``LLMEngine.set_overlapped_output_sink``): to their streams now, not when
        that call returns."""
        self._deliver(outputs)
        try:
            self.metrics.on_outputs(outputs)
        except Exception:  # metrics must never stop the engine
            logger.exception("updating metrics failed")

    def _deliver(self, outputs: Iterable[RequestOutput]) -> None:
        """Hand a step's outputs to their streams: one call into each event
        loop per step, not one per output (a cross-thread call wakes the loop,
        which then contends for the GIL with this thread: ~12 us per output at
        1024 streams, ``benches/async_delivery.py``)."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Any], Any]]] = {}
        streams = self._streams
        for output in outputs:
            if output.finished:
                stream = streams.pop(output.request_id, None)
            else:
                stream = streams.get(output.request_id)
            if stream is None:
                continue
            item: RequestOutput | BaseException = output
            if output.error is not None:  # the engine failed this request's step
                item = RequestFailedError(output.error)
            if stream._accept(item):
                batch = batches.get(stream._loop)
                if batch is None:
                    batch = batches[stream._loop] = []
                batch.append((stream._queue, item))
        for loop, batch in batches.items():
            call_in_loop(loop, put_all, batch)

    def _observe(self, *, outputs: list[RequestOutput], ran: bool = False,
                 log: bool = False) -> None:
        try:
            stats = self.engine.get_stats()
            self.metrics.on_step(stats, outputs, ran=ran)
            if log:
                self.metrics.maybe_log(stats)
        except Exception:  # metrics must never stop the engine
            logger.exception("updating metrics failed")

    def _ids_in_flight(self) -> list[str]:
        return list(dict.fromkeys([*self._streams, *self.engine.request_ids()]))

    def _fail_step(self, exc: Exception) -> None:
        """``step()`` itself raised (the engine handles step failures, so this
        is a bug): fail every request in flight and keep serving."""
        self._escaped_failures += 1
        logger.exception("engine step failed; failing the requests in flight", exc_info=exc)
        ids = self._ids_in_flight()
        try:
            self.engine.abort_request(ids)
        except Exception:
            logger.exception("aborting the requests of a failed step failed")
        error = RequestFailedError(f"the engine failed this request: {type(exc).__name__}: {exc}")
        for request_id in ids:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream._put(error)
            self.metrics.forget(request_id, "error")
        self._observe(outputs=[])

    def _fail_leftovers(self, error: BaseException) -> None:
        """The thread is gone (or never ran): fail pending adds and calls and
        every open stream."""
        with self._cond:
            self._accepting = False
            self._closed = True
            ops, self._inbox = self._inbox, []
        for op in ops:
            if isinstance(op, _Add):
                call_in_loop(op.stream._loop, settle_all, [(op.accepted, error)])
            elif isinstance(op, _Call) and not op.future.done():
                op.future.set_exception(error)
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream._put(error)
