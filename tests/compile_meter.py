"""Where the test suite's time goes: per test, its wall time and JAX's trace, lowering and
XLA compile seconds (JAX's own monitoring events), to find the tests worth trimming.

    KVPAGE_COMPILE_METER_DIR=/tmp/meter bash scripts/test.sh -p compile_meter
    python tests/compile_meter.py /tmp/meter        # per-file table, heaviest first

Each pytest process (xdist worker) appends one JSON line per test to
``meter-<pid>.jsonl`` in that folder. Subprocesses a test starts (``kvpage serve``, Ray
replicas) are not metered: their time shows as wall time only."""

from __future__ import annotations

import collections
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
          "/jax/core/compile/backend_compile_duration": "compile"}
FIELDS = ("wall", "trace", "lower", "compile", "compiles")

_totals: dict[str, float] = dict.fromkeys(FIELDS[1:], 0.0)


def _on_duration(event: str, duration: float, **_: Any) -> None:
    field = EVENTS.get(event)
    if field is not None:
        _totals[field] += duration
        _totals["compiles"] += field == "compile"


def pytest_configure(config: Any) -> None:
    import jax.monitoring

    folder = os.environ.get("KVPAGE_COMPILE_METER_DIR")
    if not folder:
        raise SystemExit("compile_meter: set KVPAGE_COMPILE_METER_DIR to a folder")
    Path(folder).mkdir(parents=True, exist_ok=True)
    config._compile_meter = open(Path(folder) / f"meter-{os.getpid()}.jsonl", "a")
    jax.monitoring.register_event_duration_secs_listener(_on_duration)


def pytest_unconfigure(config: Any) -> None:
    out = getattr(config, "_compile_meter", None)
    if out is not None:
        out.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: Any, nextitem: Any) -> Iterator[None]:
    before, start = dict(_totals), time.perf_counter()
    yield
    row = {k: _totals[k] - before[k] for k in _totals}
    row["wall"] = time.perf_counter() - start
    row["id"] = item.nodeid
    item.config._compile_meter.write(json.dumps(row) + "\n")
    item.config._compile_meter.flush()


def summarize(folder: Path, top: int = 40) -> None:
    """Print the metered seconds per test file, heaviest first, and the whole run's."""
    files: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for path in sorted(folder.glob("meter-*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            for field in FIELDS:
                files[row["id"].split("::")[0]][field] += row[field]
                files["(all)"][field] += row[field]
    print(f"{'wall s':>8} {'trace':>7} {'lower':>7} {'compile':>8} {'compiles':>8}  file")
    for name, c in sorted(files.items(), key=lambda item: -item[1]["wall"])[: top + 1]:
        print(f"{c['wall']:8.1f} {c['trace']:7.1f} {c['lower']:7.1f} {c['compile']:8.1f} "
              f"{int(c['compiles']):8d}  {name}")


if __name__ == "__main__":
    summarize(Path(sys.argv[1]))
