"""Compile-once executables, shared by the engine thread and the background compiler.

This file owns :class:`ExecutableCache`: a key is built at most once however many threads
ask for it at the same time (the first builds, the others wait for its result), and a
failed build leaves no trace, so the next request for the key tries again.

Invariants: a key is in at most one of ``done`` and ``pending``; ``done`` only grows.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Hashable
from typing import Any


class ExecutableCache:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done: dict[Hashable, Any] = {}
        self._pending: dict[Hashable, concurrent.futures.Future[Any]] = {}

    def get(self, key: Hashable) -> Any | None:
        """The built value of ``key``, or None (not built yet, or still building)."""
        return self._done.get(key)

    def is_pending(self, key: Hashable) -> bool:
        return key in self._pending

    def ready_keys(self) -> list[Hashable]:
        with self._lock:
            return list(self._done)

    def get_or_build(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """The value of ``key``: built now by this thread, or awaited from the thread
        already building it. A build's exception reaches every waiter."""
        with self._lock:
            if key in self._done:
                return self._done[key]
            future = self._pending.get(key)
            owner = future is None
            if future is None:
                future = self._pending[key] = concurrent.futures.Future()
        if not owner:
            return future.result()
        try:
            value = build()
        except BaseException as err:
            with self._lock:
                del self._pending[key]
            future.set_exception(err)
            raise
        with self._lock:
            self._done[key] = value
            del self._pending[key]
        future.set_result(value)
        return value
