"""``kvpage bench host``: what the host costs per step, device excluded.

The full ``LLMEngine`` -- schedule, step inputs, update, detokenization, stop
strings and the ``RequestOutput``s -- runs with the device replaced by an
instant token source (:class:`InstantRunner`): every sampled row gets the
next token of a fixed English text (with multi-byte characters), so the
detokenizer does real work on a real byte-level BPE vocabulary (the default
model's). ``running`` sequences decode together; after they are all past
their prompts, ``steps`` steps are timed.

Two output modes: ``streaming`` (per-step text deltas, as the async server
asks for them: ``delta=True``) and ``final`` (``final_only``, as ``LLM.generate``
does: text is still made every step, outputs only at the end).

The engine runs as a server runs it: detokenization in the Rust core and the
startup heap frozen for the garbage collector (``kvpage.system.gc_heap``, done by
``AsyncLLMEngine.start``); ``--python-detokenizer`` and ``--no-gc-freeze`` undo
either, to measure what each is worth.

``--constrained-fraction 0.5``: half the requests follow a JSON schema (an
array of strings, which never has to end); the engine computes their grammar
masks in the Rust core each step, as with a real device, and the instant runner
picks each constrained row's text token where the grammar allows it, else the
lowest token id it allows. The mask time per constrained sequence per step is
printed too.

Printed: host microseconds per step and per running sequence per step (wall
time, and the engine thread's CPU time, which a busy shared host disturbs
less), and
where they go -- ``schedule`` and ``update`` (the Rust scheduler through its
binding), ``inputs`` (packing the step's device input, as the real runner does
before a dispatch), and ``text+outputs`` (the rest: detokenization, stop
strings, output assembly, per-token bookkeeping).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvpage.bench.common import format_table, write_json
from kvpage.runner.step_inputs import PackedLayout, PaddingValues
from kvpage.runner.step_output import StepOutput

if TYPE_CHECKING:
    from kvpage._core import StepPlan

SIZES = (256, 1024, 4096)
MODES = ("streaming", "final")
TEXT = (
    "The engine schedules one step at a time: finished sequences leave and waiting ones join. "
    "Blocks of the KV cache are shared copy-on-write between a prompt and its samples. "
    "Ünïcödé text, émojis 🙂🚀 and 中文字符 must round-trip byte by byte, "
    "even when one character spans two tokens.\n"
    "def step(self):\n    plan = self.scheduler.schedule()\n    return plan\n"
)
"""The text the instant runner generates, token by token, from a per-seat offset."""
NEVER_STOP = "\n###END###"
"""A stop string every request carries and none meets, so stop matching is timed."""


class _Pending:
    __slots__ = ("_out",)

    def __init__(self, out: Any) -> None:
        self._out = out

    def result(self) -> Any:
        return self._out


class InstantRunner:
    """A :class:`~kvpage.runner.protocol.StepRunner` that needs no device: ``dispatch``
    packs the step's input buffer exactly as the real runner does (that host cost is
    real) and then returns, for each sampled row, the next token of ``token_cycle``
    for that row's seat. Deterministic; costs O(rows) numpy. Nothing to compile;
    ``num_scheduler_steps > 1`` runs several decode steps per call, as the real one."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        token_cycle: list[int],
        num_scheduler_steps: int = 1,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.num_scheduler_steps = num_scheduler_steps
        self.multi_step_max_rows = max_num_seqs
        self._cycle = np.asarray(token_cycle, np.int32)
        self._pos = np.zeros(max_num_seqs, np.int64)
        self._padding = PaddingValues(num_blocks * block_size, num_blocks, max_num_seqs, num_blocks)
        self._layouts: dict[tuple[int, int], tuple[PackedLayout, np.ndarray]] = {}
        self._step_counter = 0
        self.inputs_s = 0.0
        """Seconds spent packing step inputs."""
        self.mask_s = 0.0
        """Seconds spent computing grammar masks (the engine's ``token_bitmask_fn``)."""
        self.last_enqueue_time = 0.0
        """As ``ModelRunner.last_enqueue_time``: when the last step was "enqueued"."""
        self.last_bitmask_overlapped = False

    @property
    def background_compiler(self) -> None:
        return None

    def warmup(self, progress: bool = True) -> None:
        return None

    def start_background_compile(self) -> None:
        return None

    def set_request(
        self, seat: int, params: Any, prompt_token_ids: Any = (), output_token_ids: Any = ()
    ) -> None:
        self._pos[seat] = (seat * 7919 + len(prompt_token_ids)) % len(self._cycle)

    def free_request(self, seat: int) -> None:
        return None

    def update_params(self, params: Any) -> int:
        return 0

    def recover_device_state(self) -> bool:
        return False

    def dispatch(
        self,
        plan: StepPlan,
        prompt_targets: np.ndarray | None = None,
        token_bitmask_fn: Callable[[], np.ndarray] | None = None,
    ) -> _Pending:
        start = time.perf_counter()
        t, s = int(plan.num_tokens), int(plan.num_seqs)
        n = len(plan.logits_indices)
        key = (1 << max(t - 1, 0).bit_length(), 1 << max(max(s, n) - 1, 0).bit_length())
        entry = self._layouts.get(key)
        if entry is None:
            layout = PackedLayout(key[0], key[1], 64, self.max_blocks_per_seq)
            entry = self._layouts[key] = (layout, layout.template(self._padding))
        layout, template = entry
        layout.pack(plan, template, self.block_size, self._step_counter, False, True)
        self._step_counter += 1
        tokens = self._next_tokens(np.asarray(plan.sample_rows))
        self.last_enqueue_time = time.perf_counter()
        self.inputs_s += self.last_enqueue_time - start
        if token_bitmask_fn is not None:  # as the real runner: masks while the "device" runs
            mask_start = time.perf_counter()
            masks = token_bitmask_fn()
            self.mask_s += time.perf_counter() - mask_start
            tokens = _allowed_tokens(tokens, masks)
        return _Pending(_output(tokens))

    def multi_step_ready(self, num_rows: int) -> bool:
        return True

    def prepare_multi_step(self, num_rows: int) -> None:
        return None

    def dispatch_multi_step(self, plan: StepPlan, num_steps: int) -> _Pending:
        rows = np.asarray(plan.sample_rows)
        self._step_counter += num_steps
        self.last_enqueue_time = time.perf_counter()
        return _Pending([_output(self._next_tokens(rows)) for _ in range(num_steps)])

    def _next_tokens(self, seats: np.ndarray) -> np.ndarray:
        """The next token of the cycle for each seat."""
        pos = self._pos[seats]
        self._pos[seats] = pos + 1
        return self._cycle[pos % len(self._cycle)]


def _output(tokens: np.ndarray) -> StepOutput:
    n = len(tokens)
    return StepOutput(tokens, np.full(n, -1.0, np.float32), np.ones(n, np.int32))


def _allowed_tokens(tokens: np.ndarray, masks: np.ndarray) -> np.ndarray:
    """Each row's token if its grammar mask allows it, else the lowest allowed token id
    (so a constrained row keeps following the text wherever its grammar permits)."""
    tokens = tokens.copy()
    words = masks.view(np.uint32)
    rows = np.arange(len(tokens))
    allowed = (words[rows, tokens >> 5] >> (tokens & 31).astype(np.uint32)) & 1
    for row in np.flatnonzero(allowed == 0):
        bits = np.unpackbits(words[row].view(np.uint8), bitorder="little")
        tokens[row] = int(np.flatnonzero(bits)[0])
    return tokens


CONSTRAINT_SCHEMA = {"type": "array", "items": {"type": "string"}}
"""What constrained requests follow: a JSON array of strings never has to end, so a
constrained sequence keeps running; the text's tokens fit inside its strings."""


class _TimedScheduler:
    """The engine's scheduler, with the time of ``schedule`` and ``update`` added up."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.schedule_s = 0.0
        self.update_s = 0.0

    def schedule(self) -> Any:
        start = time.perf_counter()
        plan = self._inner.schedule()
        self.schedule_s += time.perf_counter() - start
        return plan

    def update(self, *args: Any) -> Any:
        start = time.perf_counter()
        out = self._inner.update(*args)
        self.update_s += time.perf_counter() - start
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@dataclass(slots=True)
class HostResult:
    running: int
    mode: str
    steps: int
    us_per_step: float
    us_per_seq: float
    cpu_us_per_seq: float
    schedule_us: float
    update_us: float
    inputs_us: float
    text_outputs_us: float
    outputs_per_step: float
    chars_per_step: float
    constrained: int = 0
    """Sequences following a grammar (``--constrained-fraction``)."""
    mask_us_per_constrained_seq: float = 0.0
    """Host microseconds of grammar masks per constrained sequence per step."""

    def row(self) -> list[Any]:
        return [
            self.running, self.mode, self.us_per_step / 1e3, self.us_per_seq,
            self.cpu_us_per_seq,
            self.schedule_us / 1e3, self.update_us / 1e3, self.inputs_us / 1e3,
            self.text_outputs_us / 1e3, self.outputs_per_step, self.chars_per_step,
            self.constrained, self.mask_us_per_constrained_seq,
        ]


HEADERS = [
    "running", "mode", "ms/step", "us/seq/step", "cpu us/seq/step", "schedule ms", "update ms",
    "inputs ms", "text+outputs ms", "outputs/step", "chars/step", "constrained",
    "mask us/constrained seq",
]


def load_tokenizer_and_config() -> tuple[Any, Any]:
    """The default model's byte-level BPE tokenizer and its model config."""
    from kvpage.assets import default_model_dir
    from kvpage.engine.llm_engine import load_tokenizer
    from kvpage.model.config import ModelConfig

    path = default_model_dir()
    return load_tokenizer(path), ModelConfig.from_json_file(path / "config.json")


def build_host_engine(
    running: int, *, prompt_len: int = 16, max_model_len: int = 256, tokenizer: Any = None,
    model_config: Any = None,
) -> Any:
    """An ``LLMEngine`` over :class:`InstantRunner`, sized for ``running`` sequences."""
    from kvpage.engine.config import EngineConfig
    from kvpage.engine.llm_engine import LLMEngine

    if tokenizer is None or model_config is None:
        tokenizer, model_config = load_tokenizer_and_config()
    defaults = EngineConfig()
    block_size = defaults.block_size
    num_blocks = running * (-(-max_model_len // block_size)) + 8
    config = EngineConfig(
        max_num_seqs=running,
        max_num_batched_tokens=max(defaults.max_num_batched_tokens, running * prompt_len),
        block_size=block_size,
        num_gpu_blocks=num_blocks,
        max_model_len=max_model_len,
        enable_prefix_caching=False,
        compilation_cache_dir=None,
    )
    cycle = tokenizer(TEXT * 4)["input_ids"]
    runner = InstantRunner(num_blocks, block_size, max_model_len, running, cycle)
    return LLMEngine(config, model_config, None, tokenizer, runner=runner)


HOST_PROMPT_LEN, HOST_MAX_MODEL_LEN = 16, 256


def measure(
    running: int, mode: str, steps: int = 50, *, tokenizer: Any = None, model_config: Any = None,
    rust_detokenization: bool = True, gc_freeze: bool = True, constrained_fraction: float = 0.0,
) -> HostResult:
    """Host microseconds per step with ``running`` sequences decoding; with
    ``gc_freeze`` the startup heap is frozen while it runs, as a server's is."""
    from kvpage.system.gc_heap import freeze_startup_heap, release_startup_heap

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    engine = build_host_engine(
        running, prompt_len=HOST_PROMPT_LEN, max_model_len=HOST_MAX_MODEL_LEN,
        tokenizer=tokenizer, model_config=model_config,
    )
    engine.rust_detokenization = rust_detokenization
    if gc_freeze:
        freeze_startup_heap()  # the engine is part of the startup heap, as in a server
    try:
        return _measure(engine, running, mode, steps, constrained_fraction)
    finally:
        if gc_freeze:
            release_startup_heap()


def _measure(
    engine: Any, running: int, mode: str, steps: int, constrained_fraction: float
) -> HostResult:
    from kvpage.sampling.params import SamplingParams

    prompt_len, max_model_len = HOST_PROMPT_LEN, HOST_MAX_MODEL_LEN
    warmup_steps = 4
    if steps + warmup_steps + 2 > max_model_len - prompt_len:
        raise ValueError(f"steps must be <= {max_model_len - prompt_len - warmup_steps - 2}")
    params = SamplingParams(
        max_tokens=max_model_len - prompt_len, ignore_eos=True, stop=[NEVER_STOP], temperature=0
    )
    if not 0.0 <= constrained_fraction <= 1.0:
        raise ValueError(f"constrained_fraction must be in [0, 1], got {constrained_fraction}")
    constrained_params = None
    if constrained_fraction:
        from dataclasses import replace

        from kvpage.structured_outputs import StructuredOutputsParams

        constrained_params = replace(
            params, structured_outputs=StructuredOutputsParams(json=CONSTRAINT_SCHEMA)
        )
    vocab = engine.model_config.vocab_size
    constrained = 0
    for r in range(running):
        prompt = [(r * 31 + i * 17) % (vocab - 16) + 16 for i in range(prompt_len)]
        follows_grammar = int((r + 1) * constrained_fraction) > int(r * constrained_fraction)
        constrained += follows_grammar
        engine.add_request(
            f"r{r}", prompt, constrained_params if follows_grammar else params,
            delta=mode == "streaming", final_only=mode == "final",
        )
    # Prefill, then a few decode steps, before timing.
    for _ in range(warmup_steps + running):
        if not (engine.scheduler.num_requests_waiting or engine.counters["steps"] < warmup_steps):
            break
        for out in engine.step():
            if out.error:
                raise RuntimeError(f"the engine failed a request: {out.error}")
    else:
        raise RuntimeError("the engine made no progress through the warm-up steps")
    timed = _TimedScheduler(engine.scheduler)
    engine.scheduler = timed
    runner = engine.runner
    runner.inputs_s = runner.mask_s = 0.0
    mask_rows_before = engine.counters["structured_mask_rows"]
    outputs = chars = 0
    elapsed = cpu = 0.0
    for _ in range(steps):  # only the engine is timed, not this loop reading its outputs
        start, cpu_start = time.perf_counter(), time.thread_time()
        outs = engine.step()
        elapsed += time.perf_counter() - start
        cpu += time.thread_time() - cpu_start
        outputs += len(outs)
        for out in outs:
            for completion in out.outputs:
                chars += len(completion.text)
        del outs
    engine.scheduler = timed._inner
    if engine.scheduler.num_requests_running != running:
        raise AssertionError(
            f"expected {running} running sequences, got {engine.scheduler.num_requests_running}"
        )
    per_step = 1e6 * elapsed / steps
    schedule_us = 1e6 * timed.schedule_s / steps
    update_us = 1e6 * timed.update_s / steps
    inputs_us = 1e6 * runner.inputs_s / steps
    mask_rows = engine.counters["structured_mask_rows"] - mask_rows_before
    mask_us = 1e6 * runner.mask_s / mask_rows if mask_rows else 0.0
    return HostResult(
        running=running,
        mode=mode,
        steps=steps,
        us_per_step=per_step,
        us_per_seq=per_step / running,
        cpu_us_per_seq=1e6 * cpu / steps / running,
        schedule_us=schedule_us,
        update_us=update_us,
        inputs_us=inputs_us,
        text_outputs_us=per_step - schedule_us - update_us - inputs_us,
        outputs_per_step=outputs / steps,
        chars_per_step=chars / steps,
        constrained=constrained,
        mask_us_per_constrained_seq=mask_us,
    )


def run(sizes: tuple[int, ...] = SIZES, modes: tuple[str, ...] = MODES,
        steps: int = 50, repeats: int = 3, **options: Any) -> list[HostResult]:
    """Each configuration ``repeats`` times on a fresh engine; the fastest run
    counts (other jobs on the host only ever add time)."""
    tokenizer, model_config = load_tokenizer_and_config()
    return [
        min(
            (
                measure(n, mode, steps, tokenizer=tokenizer, model_config=model_config,
                        **options)
                for _ in range(max(repeats, 1))
            ),
            key=lambda r: r.us_per_step,
        )
        for n in sizes
        for mode in modes
    ]


def add_parser(sub: Any) -> None:
    """Add ``host`` to the ``kvpage bench`` subcommands."""
    p = sub.add_parser(
        "host",
        help="host cost per step of the full engine, device replaced by an instant token source",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--running", type=int, nargs="+", default=list(SIZES),
                   help="numbers of running sequences to measure (default 256 1024 4096)")
    p.add_argument("--mode", choices=MODES, nargs="+", default=list(MODES),
                   help="streaming (per-step deltas) and/or final (final_only outputs)")
    p.add_argument("--steps", type=int, default=50, help="timed decode steps per size")
    p.add_argument("--repeats", type=int, default=3,
                   help="runs per configuration, each on a fresh engine; the fastest is shown")
    p.add_argument("--python-detokenizer", action="store_true",
                   help="stream outputs through the Python twin of the output streams "
                        "(kvpage.outputs.output_streams), not the Rust core")
    p.add_argument("--no-gc-freeze", action="store_true",
                   help="leave the startup heap to the garbage collector (no gc.freeze)")
    p.add_argument("--constrained-fraction", type=float, default=0.0,
                   help="fraction of requests following a JSON schema (structured outputs): "
                   "their grammar masks are computed in the Rust core each step (default 0)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> None:
    results = run(tuple(args.running), tuple(args.mode), args.steps, args.repeats,
                  rust_detokenization=not args.python_detokenizer,
                  gc_freeze=not args.no_gc_freeze,
                  constrained_fraction=args.constrained_fraction)
    print(format_table(HEADERS, [r.row() for r in results],
                       title="host cost per step (device replaced by an instant token source)"))
    if args.json:
        write_json(args.json, {"host": [
            {name: getattr(r, name) for name in HostResult.__slots__} for r in results
        ]})
