"""The README's figures, drawn with matplotlib from ``compare``'s result.

* ``throughput_vs_concurrency.png``: output tokens/s of the real engine vs
  client concurrency, static + contiguous vs continuous + paged, same KV pool;
* ``kv_blocks_over_time.png``: KV blocks held (solid) and blocks' worth of
  slots actually filled (dashed) after every step of the variable-length
  run, for both policies, against the pool size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

COLORS = {"static": "#c0504d", "fcfs": "#1f77b4"}
LABELS = {"static": "static batching + contiguous KV", "fcfs": "continuous batching + paged KV"}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_throughput_vs_concurrency(sweep: list[dict[str, Any]], path: str | Path,
                                   title: str = "",
                                   sim_sweep: list[dict[str, Any]] | None = None,
                                   panel_titles: tuple[str, str] = ("", "")) -> Path:
    """Output tokens/s of the engine vs concurrency (left) and, with
    ``sim_sweep``, the simulator's output tokens per step (right)."""
    plt = _pyplot()
    panels = [(sweep, "output_tokens_per_s", "output tokens / s (wall clock)")]
    if sim_sweep:
        panels.append((sim_sweep, "output_tokens_per_step", "output tokens / step"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (rows_all, key, ylabel), name in zip(axes[0], panels, panel_titles, strict=False):
        for policy in ("static", "fcfs"):
            rows = sorted((r for r in rows_all if r["policy"] == policy),
                          key=lambda r: r["max_concurrency"])
            ax.plot([r["max_concurrency"] for r in rows], [r[key] for r in rows], "o-",
                    color=COLORS[policy], label=LABELS[policy])
        ax.set_xscale("log", base=2)
        ticks = sorted({r["max_concurrency"] for r in rows_all})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("max concurrency (requests in flight)")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        if name:
            ax.set_title(name, fontsize=9)
    axes[0][0].legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_kv_blocks_over_time(runs: dict[str, dict[str, Any]], num_blocks: int,
                             path: str | Path, title: str = "") -> Path:
    """Blocks held and blocks filled after each step, both policies."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    for policy in ("static", "fcfs"):
        run = runs[policy]
        ts = run["timeline_s"]
        ax.plot(ts, run["timeline_kv_blocks"], color=COLORS[policy], lw=1.2,
                drawstyle="steps-post", label=f"{LABELS[policy]}: blocks held")
        ax.plot(ts, run["timeline_kv_filled"], color=COLORS[policy], lw=1.0, ls="--",
                drawstyle="steps-post", label=f"{LABELS[policy]}: filled with tokens")
    ax.axhline(num_blocks, color="gray", lw=0.8, ls=":", label=f"pool: {num_blocks} blocks")
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("KV blocks (16 tokens)")
    ax.set_ylim(0, num_blocks * 1.08)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center right", framealpha=0.9)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_plots(result: dict[str, Any], directory: str | Path) -> list[Path]:
    """Both figures from a ``compare`` result with its engine part."""
    if "engine" not in result:
        raise ValueError("the plots need the engine runs: drop --no-engine")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    eng = result["engine"]
    cfg = eng["engine_config"]
    pool = f"{cfg['num_gpu_blocks']} KV blocks x 16 for both policies"
    n = eng["variable"]["fcfs"]["num_requests"]
    return [
        plot_throughput_vs_concurrency(
            eng["concurrency_sweep"], directory / "throughput_vs_concurrency.png",
            title=f"outputs 20..800 tokens (log-uniform), {pool}",
            sim_sweep=result.get("sim_variable", {}).get("concurrency_sweep"),
            panel_titles=(
                f"real engine, tiny Llama on CPU, {eng['concurrency_sweep'][0]['num_requests']}"
                " requests",
                f"simulator (real scheduler), {result['sim_variable']['num_requests']} "
                "requests",
            ),
        ),
        plot_kv_blocks_over_time(
            eng["variable"], cfg["num_gpu_blocks"], directory / "kv_blocks_over_time.png",
            title=f"KV blocks in use, {n} requests (outputs 20..800 tokens), {pool}",
        ),
    ]
