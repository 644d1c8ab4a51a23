"""One engine across several processes (tensor parallelism over hosts), in lockstep.

``kvpage serve MODEL --tensor-parallel-size N --num-processes P --process-id I
--coordinator-address HOST:PORT`` starts one process per host. All of them join one
``jax.distributed`` job (:func:`join_processes`), build the same engine over the devices
of every process, and run the same steps: process 0 serves HTTP, and its engine
(:class:`LockstepLeader`, a proxy of :class:`~kvpage.engine.llm_engine.LLMEngine`)
publishes, with each step, the requests added and aborted since the previous one; every
other process (:func:`follow`) applies them to its own engine and runs the same step.
The schedulers are deterministic, so every process schedules the same batch, and the
sharded step (whose collectives need every process) samples the same tokens everywhere.

The messages go through the ``jax.distributed`` coordination service's key-value store
(no port of our own): message ``n`` under ``kvpage/lockstep/<n>``, deleted once every
process must have read it (the step's collectives keep the followers within a step of
process 0). Failures are errors, never hangs: a coordinator that cannot be reached fails
:func:`join_processes` after ``initialization_timeout`` seconds, and a process that dies
stops sending heartbeats, upon which the coordination service ends every other process
with an error naming it within ``heartbeat_timeout`` seconds.

Invariant: the ``n``-th message is built from exactly the adds and aborts that reached
process 0's engine (successfully) between its step ``n - 1`` and step ``n``, in order,
with the arrival times process 0 gave them.
"""

from __future__ import annotations

import logging
import pickle
import time
from typing import Any

logger = logging.getLogger(__name__)

KEY = "kvpage/lockstep/{}"
KEEP = 16
"""Messages kept in the store behind the newest (the followers are at most one behind)."""
FETCH_TIMEOUT_MS = 1000


def join_processes(coordinator_address: str, num_processes: int, process_id: int,
                   initialization_timeout: int = 60, heartbeat_timeout: int = 10) -> None:
    """Join the ``jax.distributed`` job (CPU collectives over gloo), or raise naming
    what failed."""
    import jax

    if not 0 <= process_id < num_processes:
        raise ValueError(f"--process-id {process_id} is outside [0, {num_processes})")
    if hasattr(jax.config, "jax_cpu_collectives_implementation"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(coordinator_address, num_processes=num_processes,
                                   process_id=process_id,
                                   initialization_timeout=initialization_timeout,
                                   heartbeat_timeout_seconds=heartbeat_timeout)
    except Exception as exc:
        raise RuntimeError(
            f"process {process_id} of {num_processes} could not join the coordinator at "
            f"{coordinator_address} within {initialization_timeout} s: {exc}") from None
    logger.info("process %d of %d joined %s: %d devices in all", process_id, num_processes,
                coordinator_address, jax.device_count())


class Channel:
    """The numbered messages, through the coordination service's key-value store."""

    def __init__(self) -> None:
        from jax._src import distributed

        self._client = distributed.global_state.client
        if self._client is None:
            raise RuntimeError("lockstep needs jax.distributed.initialize() first")

    def publish(self, n: int, message: dict[str, Any]) -> None:
        self._client.key_value_set_bytes(KEY.format(n), pickle.dumps(message))
        if n >= KEEP:
            self._client.key_value_delete(KEY.format(n - KEEP))

    def fetch(self, n: int) -> dict[str, Any]:
        """Message ``n``, waiting as long as process 0 is alive (it may idle for hours)."""
        while True:
            try:
                raw = self._client.blocking_key_value_get_bytes(KEY.format(n),
                                                                FETCH_TIMEOUT_MS)
            except Exception as exc:  # jaxlib raises one type for every status
                if "DEADLINE_EXCEEDED" in str(exc) or "deadline" in str(exc).lower():
                    continue
                raise RuntimeError(f"lost the coordinator while waiting for step "
                                   f"message {n}: {exc}") from None
            return pickle.loads(raw)


class LockstepLeader:
    """Process 0's engine: an :class:`LLMEngine` whose adds, aborts and prefix-cache
    resets are published with its next step (module docs). Everything else is the
    engine's."""

    def __init__(self, engine: Any, channel: Channel | None = None) -> None:
        self._engine = engine
        self._channel = channel or Channel()
        self._ops: list[tuple[Any, ...]] = []
        self._sent = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def add_request(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("arrival_time") is None:
            kwargs["arrival_time"] = time.monotonic()  # the followers' too
        self._engine.add_request(*args, **kwargs)
        self._ops.append(("add_request", args, kwargs))

    def abort_request(self, request_ids: Any) -> Any:
        outputs = self._engine.abort_request(request_ids)
        self._ops.append(("abort_request", (request_ids,), {}))
        return outputs

    def reset_prefix_cache(self) -> bool:
        done = self._engine.reset_prefix_cache()
        self._ops.append(("reset_prefix_cache", (), {}))
        return done

    def step(self) -> Any:
        self._send(step=True)
        return self._engine.step()

    def close(self) -> None:
        """Tell the followers to stop (after the last step)."""
        self._send(step=False, stop=True)

    def _send(self, step: bool, stop: bool = False) -> None:
        ops, self._ops = self._ops, []
        self._channel.publish(self._sent, {"ops": ops, "step": step, "stop": stop})
        self._sent += 1


def follow(engine: Any, channel: Channel | None = None) -> int:
    """Run a follower: apply process 0's messages to ``engine`` and step with it until
    told to stop; returns the number of steps run."""
    channel = channel or Channel()
    steps = 0
    n = 0
    while True:
        message = channel.fetch(n)
        n += 1
        for name, args, kwargs in message["ops"]:
            getattr(engine, name)(*args, **kwargs)
        if message["stop"]:
            return steps
        if message["step"]:
            engine.step()
            steps += 1
