"""Asynchronous rollouts: the trainer starts rollouts, keeps stepping, pushes new
weights mid-flight and collects samples as they finish.

Owns :class:`AsyncRollouts`. One thread owns the engine and steps it while work
remains; the trainer's calls (``submit``, ``push_params``, ``push_lora``) are queued and
applied between two engine steps, so a weight push lands at a step boundary while
every other sample keeps its KV and goes on. Finished samples are handed back by
``collect`` as :class:`RolloutSample`: tokens, their logprobs (``logprobs_mode`` of the
request) and which params version produced which tokens.

Staleness: a sample *started* under version ``v`` is stale once the current version
exceeds ``v + max_staleness``. With ``on_stale="abort"`` it is aborted at that push and
comes back with ``finish_reason == "abort"`` and ``stale`` set (the caller may resubmit
it); with ``"resume"`` it keeps generating under the new weights (a partial rollout:
its tokens then carry several versions).

A LoRA policy (``push_lora``): each pushed adapter becomes a new resident adapter
(its own slot, ids counting up), new samples use the newest one, and running samples
keep theirs until they finish; so at most ``max_staleness + 1`` versions are live, and
the engine needs ``max_loras >= max_staleness + 1`` (checked).

Invariants: every submitted sample is collected exactly once (finished, aborted as
stale, or failed); the engine is touched by the rollout thread only.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpage.lora.adapter import LoRAAdapter
from kvpage.lora.request import LoRARequest
from kvpage.outputs.rollout import rollout_sampling_params
from kvpage.sampling.params import SamplingParams


@dataclass
class RolloutSample:
    """One finished sample."""

    request_id: str
    index: int
    """Its place among everything submitted to this ``AsyncRollouts`` (0, 1, ...)."""
    sample_index: int
    """Which of the request's ``n`` samples."""
    prompt_token_ids: list[int]
    token_ids: np.ndarray
    logprobs: np.ndarray
    params_versions: list[tuple[int, int]]
    """(first token index, params version) ranges: who produced which tokens."""
    started_version: int
    finish_reason: str | None
    stale: bool = False


class AsyncRollouts:
    """Rollouts on ``llm``'s engine that run while the caller trains."""

    def __init__(self, llm: Any, max_staleness: int | None = None,
                 on_stale: str = "abort") -> None:
        if on_stale not in ("abort", "resume"):
            raise ValueError(f"on_stale must be 'abort' or 'resume'; got {on_stale!r}")
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0; got {max_staleness}")
        self._engine = llm.engine
        self.max_staleness = max_staleness
        self.on_stale = on_stale
        self._ops: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[RolloutSample | BaseException] = queue.SimpleQueue()
        self._live: dict[str, tuple[int, int]] = {}  # request id -> (index, started version)
        self._count = itertools.count()
        self._ids = itertools.count()
        self._wake = threading.Event()
        self._closed = False
        self._policy: LoRARequest | None = None
        self._lora_ids = itertools.count(1)
        self._thread = threading.Thread(target=self._loop, name="kvpage-rollouts", daemon=True)
        self._thread.start()

    # ---- the trainer's side --------------------------------------------------

    def submit(self, prompts: Sequence[Any], params: SamplingParams | Sequence[SamplingParams]
               ) -> list[str]:
        """Start sampling ``prompts`` (one ``params`` or one per prompt) under the newest
        weights; returns the request ids. Samples come back through :meth:`collect`."""
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(plist)} sampling params for {len(prompts)} prompts")
        ids = [f"async-{next(self._ids)}" for _ in prompts]

        def add() -> None:
            for request_id, prompt, p in zip(ids, prompts, plist, strict=True):
                try:
                    self._engine.add_request(
                        request_id, prompt, rollout_sampling_params(p), final_only=True,
                        logprobs_as_arrays=True, lora_request=self._policy,
                    )
                except Exception as e:  # a bad request fails alone
                    self._done.put(e)
                    continue
                self._live[request_id] = (next(self._count), self._engine.params_version)

        self._call(add)
        return ids

    def push_params(self, params: Any) -> None:
        """New weights (the engine's ``update_params``) from the next step on."""
        self._call(lambda: self._after_push(self._engine.update_params(params)))

    def push_lora(self, adapter: LoRAAdapter) -> None:
        """A new version of the LoRA policy: new samples run under it."""
        lora = self._engine.lora
        if lora is None:
            raise ValueError("push_lora needs an engine built with enable_lora=True")
        needed = (self.max_staleness or 0) + 1
        if len(lora.pins) - 1 < needed:
            raise ValueError(f"max_staleness={self.max_staleness} keeps up to {needed} "
                             f"policy versions resident: build the engine with "
                             f"max_loras >= {needed}")

        def push() -> None:
            lora_id = next(self._lora_ids)
            self._policy = LoRARequest(f"policy-{lora_id}", lora_id)
            self._after_push(self._engine.update_lora(self._policy, adapter))

        self._call(push)

    def collect(self, count: int | None = None, timeout: float | None = None
                ) -> list[RolloutSample]:
        """Finished samples in the order they finished: ``count`` of them (waiting up to
        ``timeout`` seconds, fewer if it passes; None waits as long as it takes), or all
        finished so far without ``count``. A request that failed raises its error here."""
        out: list[RolloutSample] = []
        while count is None or len(out) < count:
            block = count is not None
            try:
                item = self._done.get(block=block, timeout=timeout if block else None)
            except queue.Empty:
                return out
            if isinstance(item, BaseException):
                raise item
            out.append(item)
        return out

    @property
    def num_live(self) -> int:
        """Samples submitted and not collected yet (approximate while the thread runs)."""
        return len(self._live)

    def close(self) -> None:
        """Abort what still runs and stop the thread."""
        def stop() -> None:
            self._engine.abort_request(list(self._live))
            self._live.clear()
            self._closed = True

        self._call(stop)
        self._thread.join()

    # ---- the rollout thread ------------------------------------------------

    def _call(self, op: Callable[[], None]) -> None:
        if self._closed:
            raise RuntimeError("these rollouts are closed")
        self._ops.put(op)
        self._wake.set()

    def _after_push(self, version: int) -> None:
        """Abort the samples a push made stale (``on_stale="abort"``)."""
        if self.max_staleness is None or self.on_stale != "abort":
            return
        stale = [rid for rid, (_, started) in self._live.items()
                 if version - started > self.max_staleness]
        for output in self._engine.abort_request(stale):
            self._emit(output, stale=True)

    def _emit(self, output: Any, stale: bool = False) -> None:
        index, started = self._live.pop(output.request_id)
        for c in output.outputs:
            logprobs = c.logprob_array if c.logprob_array is not None else \
                np.zeros(len(c.token_ids), np.float32)
            self._done.put(RolloutSample(
                output.request_id, index, c.index, list(output.prompt_token_ids),
                np.asarray(c.token_ids, np.int32), logprobs, list(c.params_versions),
                started, c.finish_reason, stale,
            ))

    def _loop(self) -> None:
        while not self._closed:
            while True:
                try:
                    op = self._ops.get_nowait()
                except queue.Empty:
                    break
                op()
            if self._closed:
                return
            if not self._engine.has_unfinished_requests():
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                outputs = self._engine.step()
            except BaseException as e:  # the engine failed: every live sample fails
                self._done.put(e)
                self._live.clear()
                continue
            for output in outputs:
                if output.finished:
                    self._emit(output)
