"""Compiles a runner's step buckets on a daemon thread while it already serves.

This file owns :class:`BackgroundCompiler` (``warmup="background"``, the server's
default). The engine takes requests as soon as the weights are loaded; a step whose
bucket is not compiled yet runs in a compiled bucket at most
:data:`kvpage.runner.buckets.FALLBACK_MAX_RATIO` times larger (its own bucket then moves
to the front of this queue) or, when there is none, compiles its own bucket on the spot.
Meanwhile this thread compiles the rest in the order given (most useful first). XLA
compiles outside the GIL, so the engine thread keeps stepping.

Serving comes first: the thread runs at a lower CPU priority (:data:`COMPILE_NICENESS`,
Linux's per-thread nice value), so on a small machine a step's work is scheduled ahead of
LLVM's, and it takes the next key only after the one in flight is built. Keys that are
cheap to build when a step needs them (``deferrable``: loaded from the executable store,
~0.1 s) wait while the owner is ``busy`` serving: loading them holds the GIL a step's
host work needs, and a step that needs one loads it itself. It ends with one
log line saying what it built and how long it took; a key that fails to build is logged
with its traceback as an error (a bug to fix, not a condition to live with).

Invariants: the thread holds the runner only while it builds one key (a dropped runner
ends the thread after that build); :func:`stop_all` (run at interpreter exit) stops every
thread and waits for the build in flight, so no XLA compile outlives the interpreter.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Iterable
from typing import Any

logger = logging.getLogger("kvpage.compile")

_LIVE: weakref.WeakSet[BackgroundCompiler] = weakref.WeakSet()

BUSY_POLL_S = 0.05
"""How often a thread holding only deferred keys asks whether its owner is still busy."""

COMPILE_NICENESS = 10
"""How much lower than the serving threads the compile thread is scheduled (nice value
added to its own thread; XLA:CPU compiles on the calling thread)."""


def _lower_priority() -> None:
    """Raise this thread's nice value by :data:`COMPILE_NICENESS` (Linux: per thread)."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid)
                       + COMPILE_NICENESS)
    except (AttributeError, OSError):  # not Linux, or not permitted: same priority
        pass


class BackgroundCompiler:
    """Builds ``keys`` in order on a daemon thread through ``owner``'s ``build_name``
    method (looked up through a weak reference on each key); ``deferrable`` keys wait
    while ``owner``'s ``busy_name`` method says it is serving."""

    def __init__(self, owner: Any, build_name: str, keys: Iterable[Hashable],
                 deferrable: Callable[[Hashable], bool] | None = None,
                 busy_name: str | None = None) -> None:
        self._owner = weakref.ref(owner)
        self._build_name = build_name
        self._queue: list[Hashable] = list(keys)
        self._deferrable = deferrable
        self._busy_name = busy_name
        """``owner``'s method saying whether it is serving (looked up weakly, as
        ``build_name``)."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._idle = threading.Event()
        self.built = 0
        self._building = 0
        self._building_key: Hashable | None = None
        self._closed = False
        """The thread took its last key (set under the lock: :meth:`promote`)."""
        self._deferred: set[Hashable] | None = None
        """The deferrable keys (known once the thread has started)."""
        self.failed: list[tuple[Hashable, str]] = []
        self._thread = threading.Thread(target=self._run, name="kvpage-compile", daemon=True)
        _LIVE.add(self)
        self._thread.start()

    def promote(self, key: Hashable) -> bool:
        """Build ``key`` next, after the one in flight (a step is waiting in a larger
        bucket for it, or multi-step decode is asked for); False when the thread has
        already finished its queue (nothing more will be built)."""
        with self._lock:
            if self._closed:
                return False
            if key in self._queue:
                self._queue.remove(key)
            self._queue.insert(0, key)
            return True

    @property
    def remaining(self) -> int:
        return len(self._queue)

    @property
    def pending(self) -> int:
        """Keys not built yet: the queue and the one in flight."""
        return len(self._queue) + self._building

    @property
    def compiles_left(self) -> bool:
        """Whether a key that is not deferrable (a real compile, not a load from the
        store) is queued or building: while only deferred keys are left, a busy owner
        may never let them build, so whoever waits for the compiles must not wait for
        them."""
        with self._lock:
            deferred = self._deferred
            if deferred is None:
                return bool(self._queue) or self._building > 0
            keys = [*self._queue, *([self._building_key] if self._building else [])]
            return any(key not in deferred for key in keys)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every key is built (True) or ``timeout`` passes (False)."""
        return self._idle.wait(timeout)

    def stop(self, timeout: float | None = 60.0) -> None:
        """Build nothing more; wait for the build in flight."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _next(self, deferred: set[Hashable]) -> Hashable | None:
        """The next key to build; while the owner is busy, the first one not deferred
        (waiting for either). None: the queue is empty or the thread is stopping."""
        while not self._stop.is_set():
            owner = self._owner()
            if owner is None:
                with self._lock:
                    self._closed = True
                return None
            busy = self._busy_name is not None and getattr(owner, self._busy_name)()
            del owner
            with self._lock:
                if not self._queue:
                    self._closed = True
                    return None
                for i, key in enumerate(self._queue):
                    if not (busy and key in deferred):
                        self._building = 1  # pending from the moment it leaves the queue
                        self._building_key = key
                        return self._queue.pop(i)
            self._stop.wait(BUSY_POLL_S)
        with self._lock:
            self._closed = True
        return None

    def _run(self) -> None:
        _lower_priority()
        start = time.perf_counter()
        with self._lock:
            keys = list(self._queue)
        deferred = set() if self._deferrable is None else set(filter(self._deferrable, keys))
        with self._lock:
            self._deferred = deferred
        try:
            while not self._stop.is_set():
                key = self._next(deferred)
                if key is None:
                    if self._stop.is_set() or self.remaining:
                        return
                    logger.info(
                        "background compile done: %d executables built in %.1f s%s",
                        self.built, time.perf_counter() - start,
                        f", {len(self.failed)} failed" if self.failed else "",
                    )
                    return
                owner = self._owner()
                if owner is None:
                    return
                build: Callable[[Hashable], Any] = getattr(owner, self._build_name)
                self._building = 1
                try:
                    build(key)
                    self.built += 1
                except Exception as err:  # a bad bucket must not end the thread
                    logger.error("background compile of %s failed", key, exc_info=err)
                    self.failed.append((key, f"{type(err).__name__}: {err}"))
                finally:
                    self._building = 0
                del owner, build
        finally:
            self._idle.set()


@atexit.register
def stop_all() -> None:
    """Stop every background compiler and wait for its build in flight."""
    for compiler in list(_LIVE):
        compiler.stop()
