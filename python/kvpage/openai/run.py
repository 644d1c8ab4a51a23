"""Running the server: :func:`run_server`, behind ``kvpage serve``.

Load a model, serve :func:`~kvpage.openai.app.build_app` with uvicorn (on 127.0.0.1
unless told otherwise; with a bounded waiting queue) and, on SIGTERM or SIGINT,
stop accepting, let running requests finish within a bounded grace period, check
that every KV block is back in the pool (:func:`check_engine_at_exit`), and return
(the process exits 0).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Generator, Sequence
from pathlib import Path
from typing import Any

from kvpage.engine.async_engine import AsyncLLMEngine
from kvpage.engine.config import EngineConfig
from kvpage.lora.request import LoRARequest
from kvpage.model.tokenizer_cache import CachedTokenizer
from kvpage.openai.app import build_app
from kvpage.openai.guard import DEFAULT_MAX_BODY_BYTES

logger = logging.getLogger(__name__)

DEFAULT_GRACE_SECONDS = 30.0
DEFAULT_WAITING_PER_SEQ = 4
"""``run_server`` bounds the waiting queue at this many requests per running
slot (at least ``_MIN_DEFAULT_WAITING``) unless ``max_num_waiting`` is set."""
_MIN_DEFAULT_WAITING = 64


class _UvicornServer:
    """uvicorn's Server, with signal handling of our own: the first SIGTERM or
    SIGINT stops the engine accepting work and starts uvicorn's graceful
    shutdown (bounded by ``timeout_graceful_shutdown``); a second SIGINT
    forces it. Unlike uvicorn's own handling, the signal is not re-raised
    afterwards, so the process can exit 0."""

    def __init__(self, config: Any, on_signal: Callable[[], None]) -> None:
        import uvicorn

        outer = self

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Generator[None, None, None]:
                yield from outer._capture(self)

        self.server = Server(config)
        self._on_signal = on_signal

    def _capture(self, server: Any) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handle(signum: int, frame: Any) -> None:
            logger.info("received %s: finishing running requests, then exiting",
                        signal.Signals(signum).name)
            self._on_signal()
            if server.should_exit and signum == signal.SIGINT:
                server.force_exit = True
            server.should_exit = True

        previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def run(self) -> None:
        self.server.run()


def run_server(
    model_dir: str | Path,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    engine_config: EngineConfig | None = None,
    *,
    served_model_name: str | Sequence[str] | None = None,
    grace_seconds: float = DEFAULT_GRACE_SECONDS,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    log_level: str = "info",
    public_metrics: bool | None = None,
    metrics_prefix: str = "kvpage",
    lora_modules: Sequence[LoRARequest] = (),
    lockstep: bool = False,
) -> None:
    """Serve the model in ``model_dir`` until SIGTERM/SIGINT; then stop
    accepting, let running requests finish for up to ``grace_seconds``, abort
    the rest, check the engine's KV pool and return.

    ``engine_config.model`` is set to ``model_dir``; an unset
    ``max_num_waiting`` becomes ``DEFAULT_WAITING_PER_SEQ * max_num_seqs`` (at
    least 64), so that past capacity the server answers 503 instead of
    queueing without bound. ``api_key`` defaults to the ``KVPAGE_API_KEY``
    environment variable; without either the API is open.
    ``public_metrics`` (default: the ``KVPAGE_PUBLIC_METRICS`` environment
    variable is 1) serves ``/metrics`` without the key. ``served_model_name``
    defaults to ``model_dir`` as given. ``metrics_prefix`` "vllm" names the
    Prometheus series ``vllm:*`` (vLLM's dashboards work unchanged). ``lora_modules``
    (needs ``enable_lora``): adapters served under their names, loaded at startup.
    ``lockstep``: this is process 0 of a multi-process engine
    (:mod:`kvpage.engine.lockstep`); the followers stop when it does.
    """
    import uvicorn

    from kvpage.system.extras import SERVE_MODULES, require

    require("kvpage serve", SERVE_MODULES)

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine, app = build_server(model_dir, engine_config, served_model_name=served_model_name,
                               api_key=api_key, max_body_bytes=max_body_bytes,
                               public_metrics=public_metrics, metrics_prefix=metrics_prefix,
                               lora_modules=lora_modules, lockstep=lockstep)
    signalled: list[float] = []

    def on_signal() -> None:
        engine.stop_accepting()
        if not signalled:  # at the end of the grace period, end what still runs
            signalled.append(time.monotonic())
            timer = threading.Timer(grace_seconds, engine.abort_all)
            timer.daemon = True
            timer.start()

    try:
        # uvicorn's own bound only matters if aborted streams fail to close
        uv_config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                   timeout_graceful_shutdown=math.ceil(grace_seconds) + 5,
                                   lifespan="off")
        _UvicornServer(uv_config, on_signal).run()
    finally:
        spent = time.monotonic() - signalled[0] if signalled else 0.0
        engine.shutdown(max(0.0, grace_seconds - spent))
        if lockstep:
            engine.engine.close()
        check_engine_at_exit(engine)
    logger.info("server stopped")


def build_server(
    model_dir: str | Path,
    engine_config: EngineConfig | None = None,
    *,
    served_model_name: str | Sequence[str] | None = None,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    public_metrics: bool | None = None,
    metrics_prefix: str = "kvpage",
    lora_modules: Sequence[LoRARequest] = (),
    lockstep: bool = False,
) -> tuple[AsyncLLMEngine, Any]:
    """The running engine and the app :func:`run_server` serves (arguments as there),
    for a host of its own to serve (a Ray replica: :mod:`kvpage.ray.replica`)."""
    config = dataclasses.replace(engine_config or EngineConfig(), model=str(model_dir))
    if config.max_num_waiting is None:
        config = dataclasses.replace(config, max_num_waiting=max(
            _MIN_DEFAULT_WAITING, DEFAULT_WAITING_PER_SEQ * config.max_num_seqs))
    if public_metrics is None:
        public_metrics = os.environ.get("KVPAGE_PUBLIC_METRICS", "") == "1"
    if api_key is None:
        api_key = os.environ.get("KVPAGE_API_KEY") or None
    if lora_modules and not config.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    names = served_model_name or str(model_dir)
    first = names if isinstance(names, str) else names[0]
    logger.info("loading %s", model_dir)
    if lockstep:
        from kvpage.engine.llm_engine import LLMEngine
        from kvpage.engine.lockstep import LockstepLeader

        leader: Any = LockstepLeader(LLMEngine.from_config(config))
        engine = AsyncLLMEngine(leader, model_name=first, metrics_prefix=metrics_prefix)
    else:
        engine = AsyncLLMEngine.from_config(config, model_name=first,
                                            metrics_prefix=metrics_prefix)
    try:
        for lora in lora_modules:  # a bad adapter stops the start, naming the problem
            assert engine.engine.lora is not None
            engine.engine.lora.add_adapter(lora)
        tokenizer = engine.tokenizer
        if isinstance(tokenizer, CachedTokenizer):  # chat templates need the HF tokenizer:
            # built once the warm-up is done (its import holds the GIL for ~1.5 s, which the
            # first requests' steps need more), or by the first chat request, if earlier
            tokenizer.prepare_in_background(
                after=lambda: engine.engine.step_executables_pending() == 0)
        app = build_app(engine, served_model_name=names, api_key=api_key,
                        max_body_bytes=max_body_bytes, public_metrics=public_metrics,
                        lora_modules=lora_modules)
    except BaseException:
        engine.shutdown(0.0)
        raise
    return engine, app


def check_engine_at_exit(engine: AsyncLLMEngine) -> bool:
    """After ``shutdown``: log whether every KV block is back in the pool and
    the engine's invariants hold (``LLMEngine.check_invariants``); returns
    that. Skipped (False) while the engine thread still runs."""
    if engine.is_running:
        logger.error("engine state at exit: not checked, the engine thread still runs")
        return False
    inner = engine.engine
    try:
        inner.check_invariants()
        stats = inner.get_stats()
    except Exception as exc:
        logger.error("engine state at exit: invariants violated: %s", exc)
        return False
    usage = float(stats.get("kv_cache_usage_perc", 0.0))
    unfinished = int(stats.get("num_unfinished_requests", 0))
    ok = usage == 0.0 and unfinished == 0
    log = logger.info if ok else logger.error
    log("engine state at exit: %d unfinished requests, KV cache usage %.2f%%, %s",
        unfinished, 100.0 * usage,
        "all KV blocks free, invariants hold" if ok else "KV blocks still held")
    return ok
