"""Tests of ``kvpage bench``: the commands' core functions on tiny inputs.

The seeds' worked example (46.9% static slot efficiency) and the prefix
sharing counts (208 -> 13 blocks with forks) are checked exactly; the engine
benchmarks run a handful of short requests on the tiny random Llama, and
``bench serve`` loads an in-process server on a loopback port.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvpage.bench import compare_sim, serve
from kvpage.bench.common import (
    BenchRequest,
    build_engine,
    fit_to_model_len,
    format_table,
    load,
    run_requests,
    synthetic_requests,
)
from kvpage.bench.throughput import run_throughput, throughput_line
from kvpage.cli import build_parser, main
from kvpage.engine.config import EngineConfig

THROUGHPUT_LINE = re.compile(
    r"^Throughput: \d+\.\d{2} requests/s, \d+\.\d{2} total tokens/s, "
    r"\d+\.\d{2} output tokens/s$"
)


def small_config(model_dir: Path, policy: str = "fcfs") -> EngineConfig:
    """Few step buckets, so the tests compile little."""
    return EngineConfig(model=str(model_dir), max_num_seqs=4, max_num_batched_tokens=64,
                        max_model_len=128, num_gpu_blocks=64, scheduling_policy=policy)


# ---- lesson 1 and 2 without a model ---------------------------------------------------


def test_seeds_worked_example_is_46_9_percent() -> None:
    assert compare_sim.static_slot_efficiency([32, 128, 64, 256]) == pytest.approx(480 / 1024)
    result = compare_sim.seeds_example_sim()
    assert (result["useful_slots"], result["held_slots"]) == (480, 1024)
    assert f"{100 * result['static']['slot_efficiency']:.1f}" == "46.9"
    # One batch and no queue: continuous batching has nobody to seat either.
    assert result["fcfs"]["slot_efficiency"] == pytest.approx(480 / 1024)
    assert result["static"]["steps"] == result["fcfs"]["steps"] == 256


def test_prefix_sharing_block_counts() -> None:
    p = compare_sim.prefix_sharing(num_convs=16, system_len=200, block_size=16)
    assert p["unshared_blocks"] == 208
    assert p["forked_blocks"] == 13  # forks share every block, the partial one too
    assert p["prefix_cache_shared_full_blocks"] == 12
    assert p["prefix_cache_blocks"] == 12 + 16  # the partial 13th is per conversation
    assert p["prefix_cache_tokens_matched"] == [0] + [192] * 15
    assert p["scheduler_n_forks_blocks_after_prefill"] == 13
    assert p["scheduler_prefix_cache_hit_blocks"] == 15 * 12


def test_sim_paged_wastes_little_and_static_contiguous_much() -> None:
    reqs = compare_sim.sharegpt_requests(120, seed=1)
    reqs = [r for r in reqs if len(r.prompt_token_ids) + r.output_len <= 2048]
    static, exact, paged = compare_sim.sim_policies(reqs, num_blocks=2048, max_model_len=2048,
                                                max_num_seqs=64)
    assert paged["kv_waste"] < 0.04 < 0.6 < static["kv_waste"]
    assert exact["kv_waste"] < static["kv_waste"]
    assert paged["output_tokens_per_step"] > 2 * static["output_tokens_per_step"]


def test_compare_without_engine_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "compare.json"
    rc = main(["bench", "compare", "--no-engine", "--sim-requests", "40", "--sim-blocks", "1024",
               "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "46.9%" in printed and "radix prefix cache" in printed
    data = json.loads(out.read_text())
    assert data["prefix_sharing"]["forked_blocks"] == 13
    assert {r["label"] for r in data["sim_sharegpt"]["runs"]} >= {"continuous + paged"}


# ---- helpers and the CLI -------------------------------------------------------------


def test_every_bench_flag_has_help(capsys: pytest.CaptureFixture) -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    bench = sub.choices["bench"]
    bench_sub = next(a for a in bench._actions if a.dest == "bench_command")
    assert set(bench_sub.choices) == {
        "throughput", "serve", "scheduler", "host", "compare", "vs-hf", "step-profile",
        "roofline", "startup", "vs-llama-cpp", "rollout", "moe", "spec", "lora", "scaleout",
    }
    for name, p in bench_sub.choices.items():
        for action in p._actions:
            assert action.help, f"bench {name} {action.option_strings or action.dest} lacks help"
        with pytest.raises(SystemExit) as exit_info:
            main(["bench", name, "--help"])
        assert exit_info.value.code == 0
    assert "--random-weights" in capsys.readouterr().out


def test_bench_rollout_without_tunix_says_what_to_install(
    capsys: pytest.CaptureFixture,
) -> None:
    try:
        import tunix  # noqa: F401
    except ImportError:
        assert main(["bench", "rollout"]) == 2
        assert "pip install 'kvpage[tunix]'" in capsys.readouterr().out
    else:
        pytest.skip("tunix is installed here")


def test_workload_and_table_helpers() -> None:
    reqs = synthetic_requests(20, dataset="sharegpt", input_len=230, output_len=200,
                              vocab_size=512, seed=3, request_rate=5.0)
    assert all(10 <= t < 512 for r in reqs for t in r.prompt_token_ids)
    arrivals = [r.arrival for r in reqs]
    assert arrivals == sorted(arrivals) and arrivals[-1] > 0
    fixed = synthetic_requests(3, input_len=8, output_len=4, prefix_len=5, vocab_size=100)
    assert all(len(r.prompt_token_ids) == 13 and r.output_len == 4 for r in fixed)
    assert fixed[0].prompt_token_ids[:5] == fixed[1].prompt_token_ids[:5]
    fitted, changed = fit_to_model_len([BenchRequest(list(range(10, 200)), 100)], 128)
    assert changed == 1 and fitted[0].output_len == 64 and len(fitted[0].prompt_token_ids) == 64
    table = format_table(["a", "b"], [[1, 0.5], [22, float("nan")]])
    assert table.splitlines()[0].split() == ["a", "b"] and "-" in table.splitlines()[-1]
    with pytest.raises(ValueError, match="loopback"):
        serve.check_loopback("http://10.0.0.1:8000")
    serve.check_loopback("http://127.0.0.1:8000")
    serve.check_loopback("http://localhost:1")


# ---- the engine ------------------------------------------------------------------------


def test_throughput_on_tiny_model(tiny_model_dir: Path) -> None:
    loaded = load(str(tiny_model_dir))
    reqs = synthetic_requests(6, input_len=12, output_len=6, range_ratio=0.5,
                              vocab_size=loaded.vocab_size)
    result, info = run_throughput(loaded, small_config(tiny_model_dir), reqs, warmup=False)
    assert result.num_requests == 6 and result.output_tokens == sum(r.output_len for r in reqs)
    assert result.requests_per_s > 0 and result.output_tokens_per_s > 0
    assert result.total_tokens_per_s > result.output_tokens_per_s
    assert THROUGHPUT_LINE.match(throughput_line(result))
    assert info["requests_shortened_to_max_model_len"] == 0


def test_static_vs_continuous_on_the_engine(tiny_model_dir: Path) -> None:
    """The worked example scaled down 8x (4, 16, 8, 32 tokens): still 46.9%
    on the real engine; in cap mode static reserves max_model_len each."""
    loaded = load(str(tiny_model_dir))
    reqs = [BenchRequest(list(range(10, 22)), n) for n in (4, 16, 8, 32)]
    static = build_engine(loaded, small_config(tiny_model_dir, "static"), warmup=False)
    r = run_requests(static, reqs, mode="exact")
    assert f"{100 * r.slot_efficiency:.1f}" == "46.9" and r.steps == 32
    capped = run_requests(static, reqs, mode="cap")
    assert capped.max_kv_blocks == 4 * 128 // 16  # 4 x max_model_len reserved up front
    assert capped.kv_waste > 0.6
    assert capped.lengths_as_drawn >= 3  # token 0 may run one token past the length
    paged = run_requests(build_engine(loaded, small_config(tiny_model_dir), warmup=False),
                         reqs, mode="cap")
    assert paged.slot_efficiency == pytest.approx(60 / (4 * paged.steps))
    assert paged.kv_waste < capped.kv_waste
    assert paged.max_kv_blocks < capped.max_kv_blocks
    assert paged.timeline_kv_blocks and len(paged.timeline_s) >= paged.steps


# ---- bench serve against an in-process server -----------------------------------------


@pytest.fixture(scope="module")
def server_url(tiny_model_dir: Path) -> Iterator[str]:
    import uvicorn
    from kvpage.engine.async_engine import AsyncLLMEngine
    from kvpage.engine.llm_engine import LLMEngine
    from kvpage.openai.app import build_app

    engine = AsyncLLMEngine(LLMEngine.from_config(small_config(tiny_model_dir)),
                            model_name="tiny", log_stats=False)
    app = build_app(engine, served_model_name="tiny")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        engine.shutdown(5)


def test_bench_serve_completes_every_request(server_url: str) -> None:
    reqs = synthetic_requests(6, input_len=10, output_len=5, vocab_size=500, request_rate=40.0)
    result = serve.bench_serve(server_url, reqs, max_concurrency=3, request_rate=40.0)
    assert result.completed == 6 and result.failed == 0
    assert result.output_tokens == 30 and result.prompt_tokens == 60
    assert result.ttft_ms["mean"] > 0 and result.request_throughput > 0
    assert result.latency_ms["p99"] >= result.ttft_ms["p99"]
    block = serve.format_result(result)
    assert "Requests completed:" in block and "P99 ITL (ms):" in block


def test_bench_serve_cli_with_json(server_url: str, tmp_path: Path,
                                   capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "serve.json"
    rc = main(["bench", "serve", "--base-url", server_url, "--num-prompts", "4",
               "--input-len", "8", "--output-len", "4", "--json", str(out)])
    assert rc == 0
    assert "Requests failed:" in capsys.readouterr().out
    data = json.loads(out.read_text())["result"]
    assert data["completed"] == 4 and data["failed"] == 0 and data["output_tokens"] == 16


def test_first_minute_token_times_and_time_to_steady_state(server_url: str) -> None:
    """Token arrival times from a real streamed run (every token once, inside the run),
    and the time-to-90 % rule on a made-up ramp."""
    import asyncio

    import numpy as np
    from kvpage.bench import first_minute

    reqs = synthetic_requests(4, input_len=8, output_len=6, vocab_size=500)
    model, _ = serve.server_info(server_url)
    records, _ = asyncio.run(serve.run_requests_online(server_url, reqs, model=model,
                                                       max_concurrency=2))
    times = first_minute.token_times(records)
    assert len(times) == 24 and (np.diff(times) >= 0).all()
    assert min(r.sent for r in records) <= times[0] and times[-1] <= time.perf_counter()
    # 10 tokens/s for 10 s, then 100 tokens/s: 90 of 100 is first reached by a 5 s window
    # ending 4.5 s into the fast phase (0.5 s of 10/s and 4.5 s of 100/s = 455 tokens).
    ramp = np.concatenate([np.arange(0, 10, 0.1), 10 + np.arange(0, 20, 0.01)])
    got = first_minute.time_to_fraction(ramp, 0.0, steady=100.0)
    assert got is not None and 14.0 <= got <= 15.0
    assert first_minute.time_to_fraction(ramp[:100], 0.0, steady=100.0) is None


def test_step_profile_runs_on_a_small_vocabulary_model(tmp_path: Path) -> None:
    """`kvpage bench step-profile` on the packaged tiny model (2048 tokens: prompts must
    come from inside its vocabulary) reports every component of the step."""
    from kvpage.assets import default_model_dir

    out = tmp_path / "profile.json"
    assert main(["bench", "step-profile", str(default_model_dir()), "--rows", "2",
                 "--context", "16", "--steps", "3", "--repeats", "1", "--json", str(out)]) == 0
    parts = json.loads(out.read_text())["components_ms"]
    assert {"dense layers (matmuls, norms, rope)", "KV write", "paged attention"} <= set(parts)
    assert all(v >= 0 for v in parts.values())
