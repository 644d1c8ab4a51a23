"""kvpage on Ray Serve (:mod:`kvpage.ray`): a local Ray cluster on this machine, two
replicas of the tiny random Llama behind kvpage's router. Skipped where ``ray[serve]``
is absent (``pip install 'kvpage[ray]'``)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

ray = pytest.importorskip("ray", reason="kvpage on Ray needs kvpage[ray]")
serve = pytest.importorskip("ray.serve")

from kvpage.bench.loopback import free_port  # noqa: E402
from kvpage.engine.config import EngineConfig  # noqa: E402
from kvpage.ray.application import RayOptions, build_app  # noqa: E402
from kvpage.ray.replica import REPLICA_HEADER, ReplicaOptions  # noqa: E402

MODEL = "tiny"
SHARED = " ".join(f"word{i}" for i in range(60))


@pytest.fixture(scope="module")
def url(tiny_model_dir: Path, hermetic_compilation_cache: Path,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    os.environ["RAY_AUTH_MODE"] = "disabled"  # no token written under the home directory
    temp = Path(f"/tmp/kvray-{os.getpid()}")  # Ray's socket paths must stay short
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, _temp_dir=str(temp),
             runtime_env={"env_vars": {"KVPAGE_EXECUTABLE_STORE": "0",
                                       "HOME": str(tmp_path_factory.mktemp("home"))}})
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        config = EngineConfig(max_num_seqs=8, max_model_len=256, max_num_batched_tokens=64,
                              compilation_cache_dir=str(hermetic_compilation_cache))
        replica = ReplicaOptions(model=str(tiny_model_dir), engine_config=config,
                                 served_model_name=[MODEL], public_metrics=True)
        serve.run(build_app(replica, RayOptions(replicas=2, num_cpus_per_replica=1,
                                                routing_stats_period_s=0.5)),
                  name="kvpage", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def _complete(url: str, prompt: str, **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, **extra}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def _metrics(url: str) -> str:
    r = httpx.get(f"{url}/metrics", timeout=30)
    assert r.status_code == 200, r.text
    return r.text


def _gauges(text: str, name: str) -> dict[str, float]:
    """Each replica's value of the gauge ``kvpage:<name>``."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(f"kvpage:{name}{{"):
            replica = line.split('replica="', 1)[1].split('"', 1)[0]
            values[replica] = values.get(replica, 0.0) + float(line.rpartition(" ")[2])
    return values


def test_routes_behave_as_kvpage_serve(url: str) -> None:
    # one prefix: the router keeps these on one replica, which alone compiles their programs
    prompt = "zeta " + SHARED
    r = _complete(url, prompt, logprobs=2, echo=True)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"].startswith(prompt) and choice["logprobs"]["top_logprobs"]
    with httpx.stream("POST", f"{url}/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "stream": True}) as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        events = [ln for ln in stream.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3
    chat = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    models = httpx.get(f"{url}/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    bad = httpx.post(f"{url}/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": prompt, "temperature": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
    assert len(_gauges(_metrics(url), "num_requests_running")) == 2  # one scrape, both


def test_requests_sharing_a_prefix_go_where_it_is_cached(url: str) -> None:
    groups = {}
    for round_ in range(3):
        for prefix in ("alpha", "beta", "gamma"):
            r = _complete(url, f"{prefix} {SHARED} question {round_}")
            assert r.status_code == 200, r.text
            groups.setdefault(prefix, []).append(
                (r.headers[REPLICA_HEADER], r.json()["usage"]["prompt_tokens_details"]))
        time.sleep(0.6)  # a routing-stats poll: the router now reads the engines' caches
    for served in groups.values():
        assert len({replica for replica, _ in served}) == 1, groups
        assert all(details["cached_tokens"] > 0 for _, details in served[1:]), groups


def _replica_actor(replica_id: str) -> Any:
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].startswith("SERVE_REPLICA::") and actor["name"].endswith(replica_id):
            return ray.get_actor(actor["name"], namespace=actor["namespace"])
    raise AssertionError(f"no actor for replica {replica_id}")


def test_a_killed_replica_is_replaced_and_no_block_leaks(url: str) -> None:
    prompt = "delta " + " ".join(SHARED.split()[:10])  # ~40 tokens: room for 200 more
    victim = _complete(url, prompt).headers[REPLICA_HEADER]
    results: list[int | str] = []
    streaming = threading.Event()

    def stream_long() -> None:
        try:
            with httpx.stream("POST", f"{url}/v1/completions", timeout=120, json={
                    "model": MODEL, "prompt": prompt, "max_tokens": 200,
                    "ignore_eos": True, "stream": True}) as s:
                lines = []
                for line in s.iter_lines():
                    if line:
                        lines.append(line)
                        streaming.set()  # tokens flow: kill the replica mid-stream
            last = lines[-1] if lines else ""
            results.append("done" if last == "data: [DONE]" else
                           "replica_failed" if "replica_failed" in last else f"cut: {last}")
        except httpx.HTTPError as exc:
            results.append(type(exc).__name__)

    threads = [threading.Thread(target=stream_long) for _ in range(2)]
    for t in threads:
        t.start()
    assert streaming.wait(60), "no stream started"
    ray.kill(_replica_actor(victim), no_restart=True)
    for t in threads:
        t.join(120)
    # a stream on the victim ended with an error event, one elsewhere in full
    assert set(results) <= {"done", "replica_failed"} and "replica_failed" in results, results
    # requests sent after the kill are served (by the survivor, then the replacement)
    for i in range(6):
        r = _complete(url, f"epsilon {i} " + SHARED)
        assert r.status_code == 200, r.text
        assert r.headers[REPLICA_HEADER] != victim
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        status = serve.status().applications["kvpage"].deployments["KvpageReplica"]
        if status.replica_states.get("RUNNING", 0) == 2:
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"the replica was not replaced: {status}")
    # idle: every replica's KV pool is empty, none holds a request
    deadline = time.monotonic() + 30
    while True:
        text = _metrics(url)
        usage, running = _gauges(text, "kv_cache_usage_perc"), \
            _gauges(text, "num_requests_running")
        if len(usage) == 2 and victim not in usage and set(usage.values()) == {0.0} \
                and set(running.values()) == {0.0}:
            break
        assert time.monotonic() < deadline, (usage, running)
        time.sleep(0.5)
