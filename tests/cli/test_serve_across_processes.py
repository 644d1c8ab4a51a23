"""``kvpage serve`` with one model across two processes (:mod:`kvpage.engine.lockstep`):
tensor parallelism 2 over ``jax.distributed`` (gloo), one CPU device per process, on this
machine. Process 0 serves HTTP; its greedy completions equal one process's, and a
follower killed takes process 0 down with an error within seconds, not a hang."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jax
import pytest
from kvpage import LLM, SamplingParams
from kvpage.bench.loopback import free_port

PROMPTS = ["The quick brown fox", "Once upon a time there was"]
ENGINE_FLAGS = ["--max-num-seqs", "4", "--max-model-len", "128",
                "--max-num-batched-tokens", "64", "--served-model-name", "tiny"]


@pytest.fixture(scope="module")
def two_processes(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[tuple[str, list[subprocess.Popen[str]]]]:
    if not hasattr(jax.config, "jax_cpu_collectives_implementation"):
        pytest.skip("this jax has no CPU cross-process collectives")
    home = tmp_path_factory.mktemp("home")
    coordinator, port = free_port(), free_port()
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1",
               JAX_PLATFORMS="cpu", HOME=str(home))
    procs = [subprocess.Popen(
        [sys.executable, "-m", "kvpage.cli", "serve", str(tiny_model_dir), "--port",
         str(port + i), "--tensor-parallel-size", "2", "--num-processes", "2",
         "--process-id", str(i), "--coordinator-address", f"127.0.0.1:{coordinator}",
         "--compilation-cache-dir", str(home / "cache"), *ENGINE_FLAGS],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True) for i in range(2)]
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert all(p.poll() is None for p in procs), _logs(procs)
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "process 0 did not serve within 180 s"
            time.sleep(0.5)
        yield url, procs
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(30)


def _logs(procs: list[subprocess.Popen[str]]) -> str:
    out = []
    for p in procs:
        if p.poll() is not None and p.stdout is not None:
            out.append(p.stdout.read()[-3000:])
    return "\n----\n".join(out)


def test_tokens_equal_one_process_and_a_dead_follower_is_an_error(
        two_processes: tuple[str, list[subprocess.Popen[str]]], tiny_model_dir: Path) -> None:
    url, procs = two_processes
    body = {"model": "tiny", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(2) as pool:  # both in one batch, as a server sees them
        answers = list(pool.map(lambda p: httpx.post(
            url + "/v1/completions", json={**body, "prompt": p}, timeout=120), PROMPTS))
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    got = [a.json()["choices"][0]["text"] for a in answers]
    llm = LLM(str(tiny_model_dir), max_num_seqs=4, max_model_len=128,
              max_num_batched_tokens=64)
    want = [o.outputs[0].text for o in llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        use_tqdm=False)]
    assert got == want

    os.killpg(procs[1].pid, signal.SIGKILL)  # the follower dies
    start = time.monotonic()
    try:  # a request now fails or the server goes away; it never hangs
        httpx.post(url + "/v1/completions", json={**body, "prompt": PROMPTS[0]}, timeout=60)
    except httpx.HTTPError:
        pass
    procs[0].wait(60)
    assert procs[0].returncode != 0
    assert time.monotonic() - start < 60
