"""The engine loop: the Rust scheduler plans a step, the JAX runner runs it,
the scheduler applies the sampled tokens, and the engine turns tokens into
text, stop strings and ``RequestOutput``s.

    engine = LLMEngine.from_config(EngineConfig(model=path))
    engine.add_request("r1", "Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for out in engine.step(): ...

Ownership (issue #17): the Rust scheduler owns every fact about a request's
progress and the engine only reads them from the step plan and ``update``:

- seats: each sequence that samples holds a *seat*, a row of the runner's device
  sampling table (its parameters, seed state and penalty history), from its first
  sampled row until it finishes or is preempted. The scheduler assigns and frees
  seats; the plan carries each sampled row's seat (``sample_rows``), the rows whose
  seat was just bound (``sample_new_seat``: the engine loads the sample's
  parameters into it) and the seats freed since the last plan (``freed_seats``).
  The engine keeps no seat state of its own.
- finish codes and stop tokens: ``kvpage._core.FINISH_REASONS`` and ``update``'s
  stop-token flag; the engine adds only what the scheduler cannot see (stop
  strings, found in the text, and failures).
- what a client is handed: the Rust core's ``OutputStreams`` (``rust/output/output_streams.rs``)
  own each sample's output tokens, text, stop strings, cumulative logprob, finish
  and what was already sent. The engine feeds them the scheduler's update events,
  asks for text and stop strings, and takes the new outputs: three calls a step,
  no token handled one at a time in Python (only top-k logprob dicts, for the
  requests that ask for them).
- first schedules and prefix-cache hits: ``plan.first_scheduled`` /
  ``first_scheduled_cached``; decode-only steps: ``plan.decode_only``.

Ids: the engine maps ``request_id`` (str) to the scheduler's ``handle``; a sample is
``(handle, sample index)``. The id spaces are documented in ``rust/sched/request.rs``.
"""

from __future__ import annotations

import array
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvpage._core import OutputStreams, Scheduler, TokenDecoder
from kvpage.engine.config import EngineConfig
from kvpage.model.config import ModelConfig
from kvpage.model.gguf_loader import is_gguf, load_gguf, load_gguf_tokenizer
from kvpage.model.loader import load_model
from kvpage.model.tokenizer_cache import TOKENIZER_DIR_NAME, load_through_cache
from kvpage.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from kvpage.outputs.detokenizer import _PROMPT_CONTEXT_TOKENS, rust_token_decoder
from kvpage.outputs.output_streams import OutputTuple, PythonOutputStreams
from kvpage.outputs.prompt_logprobs import PromptLogprobsRecord, step_prompt_targets
from kvpage.runner.model_runner import ModelRunner
from kvpage.sampling.params import SamplingParams
from kvpage.structured_outputs.compiler import GrammarCompiler
from kvpage.system.compilation_cache import cache_dir, compile_counts, enable_compilation_cache

logger = logging.getLogger("kvpage.engine.llm_engine")

PromptType = str | dict[str, Any] | Sequence[int]


class StepTiming:
    """Where a step's wall time goes: on the device (dispatch to result)
    versus the host gap between one step's result and the next dispatch,
    during which the device idles."""

    __slots__ = ("device_s", "host_gap_s", "steps")

    def __init__(self) -> None:
        self.device_s = 0.0
        self.host_gap_s = 0.0
        self.steps = 0

    def record_step(self, seconds: float) -> None:
        self.device_s += seconds
        self.steps += 1

    def record_host_gap(self, seconds: float) -> None:
        self.host_gap_s += seconds

    @property
    def device_idle_fraction(self) -> float:
        total = self.device_s + self.host_gap_s
        return self.host_gap_s / total if total else 0.0

    def as_dict(self) -> dict[str, float]:
        steps = max(self.steps, 1)
        return {
            "steps": self.steps,
            "mean_device_ms": 1e3 * self.device_s / steps,
            "mean_host_gap_ms": 1e3 * self.host_gap_s / steps,
            "device_idle_fraction": self.device_idle_fraction,
        }


class QueueFullError(RuntimeError):
    """The waiting queue is at ``max_num_waiting``: shed load (HTTP 503)."""


@dataclass(slots=True)
class _Request:
    request_id: str
    handle: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    streams: OutputStreams | PythonOutputStreams
    """The output streams holding this request's samples."""
    delta: bool
    logprobs: dict[int, list[dict[int, Logprob]]] | None = None
    """Per sample index, each output token's logprob dict (with ``params.logprobs``)."""
    logprobs_sent: dict[int, int] = field(default_factory=dict)
    """Per sample index, logprob dicts already handed out (delta outputs)."""
    logprob_arrays: dict[int, array.array] | None = None
    """Instead of ``logprobs`` (``logprobs_as_arrays``): per sample index, the sampled
    tokens' logprobs as float32 values, no Python object per token."""
    finished: bool = False
    error: str | None = None
    num_cached_tokens: int = 0
    prompt_scores: PromptLogprobsRecord | None = None
    prompt_logprobs_sent: bool = False
    score_from: int | None = None


def _merge_eos_ids(config: ModelConfig, model_dir: Path | None, tokenizer: Any) -> list[int]:
    ids = set(config.eos_token_ids)
    path = None if model_dir is None else model_dir / "generation_config.json"
    if path is not None and path.is_file():
        import json

        try:
            eos = json.loads(path.read_text()).get("eos_token_id")
        except (ValueError, AttributeError) as err:
            raise ValueError(f"{path} is not a valid generation config: {err}") from None
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)


def load_tokenizer(model_dir: str | Path) -> Any:
    """The model's Hugging Face tokenizer, from local files only."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as err:  # transformers raises many types; name the directory
        raise ValueError(f"cannot load the tokenizer of {model_dir}: {err}") from None


def load_model_and_tokenizer(
    model: str | Path,
    dtype: str = "auto",
    quantization: str = "auto",
    tensor_parallel_size: int = 1,
    tokenizer_cache_dir: Path | None = None,
) -> tuple[ModelConfig, Any, Any, Path | None]:
    """``(model_config, params, tokenizer, model_dir)`` from an HF model directory or a
    GGUF file (``model_dir`` is None for a GGUF file; ``tokenizer`` None if there is
    none). ``quantization``: :mod:`kvpage.quant.modes`. With ``tokenizer_cache_dir`` a
    start after the first reads the tokenizer without transformers
    (:mod:`kvpage.model.tokenizer_cache`)."""
    path = Path(model)
    if is_gguf(path):
        start = time.perf_counter()
        model_config, params, _ = load_gguf(
            path, dtype=dtype, quantization=quantization,
            tensor_parallel_size=tensor_parallel_size, tokenizer=False,
        )
        tokenizer = load_through_cache(path, tokenizer_cache_dir,
                                       lambda: load_gguf_tokenizer(path))
        logger.info("loaded %s (%s) in %.1f s", path, model_config.dtype,
                    time.perf_counter() - start)
        return model_config, params, tokenizer, None
    model_config, params = load_model(path, dtype=dtype, quantization=quantization)
    tokenizer = (
        load_through_cache(path, tokenizer_cache_dir, lambda: load_tokenizer(path))
        if (path / "tokenizer_config.json").is_file() or (path / "tokenizer.json").is_file()
        else None
    )
    return model_config, params, tokenizer, path


class LLMEngine:
    """Continuous batching over one model: add requests, call ``step``."""

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        params: Any,
        tokenizer: Any = None,
        model_dir: Path | None = None,
        *,
        runner: Any = None,
        mesh: Any = None,
    ) -> None:
        """``runner`` replaces the JAX ``ModelRunner`` with any object of its
        interface (``kvpage.bench.host`` passes an instant token source). ``mesh``: a
        ``jax.sharding.Mesh`` with a ``"tp"`` axis to run on (a trainer's own mesh:
        weights and KV heads split over ``"tp"``, replicated over its other axes)
        instead of ``tensor_parallel_size`` devices."""
        self.config = config
        self.model_config = model_config
        self.tokenizer = tokenizer
        max_model_len = config.max_model_len or model_config.max_position_embeddings
        if max_model_len > model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
                f"{model_config.max_position_embeddings}"
            )
        self.max_model_len = max_model_len
        batched = max(config.max_num_batched_tokens, config.max_num_seqs)
        if not config.enable_chunked_prefill:
            batched = max(batched, max_model_len)
        self.compilation_cache_dir = enable_compilation_cache(config.compilation_cache_dir)
        compiles_before = compile_counts()
        self.runner = runner or ModelRunner(
            model_config,
            params,
            config.num_gpu_blocks,
            config.block_size,
            max_model_len,
            config.attention_backend,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=batched,
            max_logprobs=config.max_logprobs,
            seed=config.seed,
            tensor_parallel_size=config.tensor_parallel_size,
            mesh=mesh,
            kv_memory_fraction=config.gpu_memory_utilization,
            kv_cache_memory=config.kv_cache_memory,
            kv_cache_dtype=config.kv_cache_dtype,
            num_scheduler_steps=config.num_scheduler_steps,
        )
        self.eos_token_ids = _merge_eos_ids(model_config, model_dir, tokenizer)
        self.rust_detokenization = True
        """Stream outputs through the Rust core's ``OutputStreams`` when it can load the
        tokenizer (False: through their Python twin, ``kvpage.outputs.output_streams``); read when
        a request is added."""
        # Loaded now (~0.5 s for a 49k vocabulary), not on the first request.
        self._token_decoder: tuple[Any, TokenDecoder | None] = (
            tokenizer,
            None if tokenizer is None else rust_token_decoder(tokenizer),
        )
        self.scheduler = Scheduler(
            self.runner.num_blocks,
            config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=batched,
            max_model_len=max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            enable_prefix_caching=config.enable_prefix_caching,
            scheduling_policy=config.scheduling_policy,
            eos_token_ids=self.eos_token_ids,
        )
        self._requests: dict[str, _Request] = {}
        self._by_handle: dict[int, _Request] = {}
        self.params_version = 0
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0}
        self.finished_counts: dict[str, int] = {}
        self._streams = OutputStreams(CompletionOutput)
        self._python_streams: PythonOutputStreams | None = None
        """Streams of requests whose tokenizer the Rust core cannot load."""
        self._logprob_handles: set[int] = set()  # requests that asked for logprobs
        self._scoring: dict[int, _Request] = {}  # requests whose prompt is being scored
        self._private_salts = 0
        self._last_result_time: float | None = None
        self.timing = StepTiming()
        self._grammar_compiler: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()
        self._constrained: set[int] = set()  # handles of requests with a grammar
        self._lookahead_plan: Any = None  # the plan a multi-step call is applying
        self.counters["structured_mask_rows"] = 0
        self.counters["structured_mask_steps"] = 0
        self.counters["structured_mask_hidden_steps"] = 0
        self.counters["structured_mask_s"] = 0.0
        if config.warmup == "full":
            self.runner.warmup(progress=True)
        elif config.warmup == "background":
            self.runner.start_background_compile()
        self.startup_compiles = compile_counts() - compiles_before
        """Executables XLA compiled (and loaded from the persistent cache) while this
        engine started; with ``warmup="background"`` the rest follow on their thread."""

    # ---- construction ---------------------------------------------------

    @classmethod
    def from_config(cls, config: EngineConfig, mesh: Any = None) -> LLMEngine:
        """Load ``config.model`` and build the engine (on ``mesh``: see ``__init__``)."""
        if config.model is None:
            raise ValueError("EngineConfig.model must name an HF model directory or a .gguf file")
        if mesh is not None:
            from kvpage.runner.tensor_parallel import mesh_size

            tensor_parallel_size = mesh_size(mesh)
        else:
            tensor_parallel_size = config.tensor_parallel_size
        cache = cache_dir(config.compilation_cache_dir)
        model_config, params, tokenizer, model_dir = load_model_and_tokenizer(
            config.model, dtype=config.dtype, quantization=config.quantization,
            tensor_parallel_size=tensor_parallel_size,
            tokenizer_cache_dir=None if cache is None else cache / TOKENIZER_DIR_NAME,
        )
        return cls(config, model_config, params, tokenizer, model_dir, mesh=mesh)

    # ---- structured outputs ---------------------------------------------

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """Compiles structured-output constraints for this model (created on first use;
        the server calls it off the event loop before ``add_request``)."""
        with self._grammar_lock:  # the server's event loop and the engine thread
            if self._grammar_compiler is None:
                self._grammar_compiler = GrammarCompiler(
                    self.tokenizer, self.model_config.vocab_size, self.eos_token_ids
                )
            return self._grammar_compiler

    def _token_bitmask(self) -> np.ndarray:
        """The grammar masks of the scheduled step's sampled rows, computed in the Rust
        core with the GIL released (``structured_mask_*`` counters: its host cost)."""
        start = time.perf_counter()
        bitmask = self.scheduler.fill_token_bitmask(self.grammar_compiler.words)
        self.counters["structured_mask_s"] += time.perf_counter() - start
        self.counters["structured_mask_rows"] += self.scheduler.num_constrained_rows()
        self.counters["structured_mask_steps"] += 1
        return bitmask

    # ---- requests -------------------------------------------------------

    def _prompt_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass prompt_token_ids instead")
            return prompt, list(self.tokenizer(prompt)["input_ids"])
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self._prompt_ids(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        return None, list(prompt)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        *,
        delta: bool = False,
        final_only: bool = False,
        arrival_time: float | None = None,
        score_from: int | None = None,
        logprobs_as_arrays: bool = False,
    ) -> None:
        """Queue a request. Raises ValueError naming what is wrong with it,
        or QueueFullError when the waiting queue is at its bound.

        ``score_from`` (with ``params.prompt_logprobs``): score only the prompt tokens
        from that index on; the prefix cache may still supply the positions before it
        (a shared prompt is computed once for all the completions scored after it).
        ``logprobs_as_arrays`` (with ``params.logprobs == 0``): each sample's sampled
        logprobs come back as one float32 array, ``CompletionOutput.logprob_array``."""
        params = params or SamplingParams()
        if not -(2**63) <= priority < 2**63:
            raise ValueError(f"priority must fit in a signed 64-bit integer, got {priority}")
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        bound = self.config.max_num_waiting
        if bound is not None and self.scheduler.num_requests_waiting >= bound:
            raise QueueFullError(f"the waiting queue is full ({bound} requests); retry later")
        text, ids = self._prompt_ids(prompt)
        vocab = self.model_config.vocab_size
        if any((not isinstance(t, int | np.integer)) or t < 0 or t >= vocab for t in ids):
            bad = next(t for t in ids if not isinstance(t, int | np.integer) or not 0 <= t < vocab)
            raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})")
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise ValueError(
                f"logprobs must be <= {self.config.max_logprobs} (max_logprobs), "
                f"got {params.logprobs}"
            )
        if (
            params.prompt_logprobs is not None
            and params.prompt_logprobs > self.config.max_logprobs
        ):
            raise ValueError(
                f"prompt_logprobs must be <= {self.config.max_logprobs} (max_logprobs), "
                f"got {params.prompt_logprobs}"
            )
        grammar = None
        if params.structured_outputs is not None:  # compile errors: ValueError, nothing queued
            grammar = self.grammar_compiler.compile(params.structured_outputs)
        max_cached_tokens = None
        if score_from is not None:
            if params.prompt_logprobs is None or not 1 <= score_from < len(ids):
                raise ValueError(
                    f"score_from must index a prompt token after the first (1 <= score_from "
                    f"< {len(ids)}) and needs prompt_logprobs, got {score_from}"
                )
            max_cached_tokens = score_from - 1  # position score_from - 1 is computed
        if logprobs_as_arrays and params.logprobs != 0:
            raise ValueError("logprobs_as_arrays needs SamplingParams(logprobs=0)")
        if (
            params.prompt_logprobs is not None
            and self.config.enable_prefix_caching
            and score_from is None
        ):
            # Bypass the prefix cache (see kvpage.outputs.prompt_logprobs): a private salt no
            # other request shares, so every prompt position is computed and scored.
            self._private_salts += 1
            cache_salt = f"{cache_salt or ''}\x00prompt_logprobs#{self._private_salts}"
        handle = self.scheduler.add_request(
            np.asarray(ids, np.int64),
            n=params.n,
            max_tokens=params.max_tokens,  # None: until max_model_len; the core clamps
            min_tokens=params.min_tokens,
            ignore_eos=params.ignore_eos,
            stop_token_ids=params.stop_token_ids,
            priority=priority,
            cache_salt=cache_salt,
            max_cached_tokens=max_cached_tokens,
        )
        if grammar is not None:
            self.scheduler.set_grammar(handle, grammar)
            self._constrained.add(handle)
        metrics = RequestMetrics(arrival_time=arrival_time or time.monotonic())
        streams = self._add_streams(handle, ids, params, delta=delta, final_only=final_only)
        request = _Request(request_id, handle, text, ids, params, metrics, streams, delta)
        if logprobs_as_arrays:
            request.logprob_arrays = {}
            self._logprob_handles.add(handle)
        elif params.logprobs is not None:
            request.logprobs = {}
            self._logprob_handles.add(handle)
        self._requests[request_id] = request
        self._by_handle[handle] = request
        if params.prompt_logprobs is not None:
            request.prompt_scores = PromptLogprobsRecord(
                ids, params.prompt_logprobs, score_from or 1
            )
            request.score_from = score_from
            if not request.prompt_scores.complete:
                self._scoring[handle] = request
        self.counters["prompt_tokens"] += len(ids)

    def abort_request(self, request_ids: str | Sequence[str]) -> list[RequestOutput]:
        """Abort requests in any state; their blocks return at once."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        outputs = []
        for request_id in ids:
            request = self._requests.get(request_id)
            if request is None:
                continue
            self.scheduler.abort_request(request.handle)
            outputs.append(self._end_request(request, "abort"))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    # ---- one step -------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns the requests that progressed.

        With ``overlap_host_work`` (the default), the text of step t's tokens
        is produced while the device runs step t + 1, so the device does not
        wait for detokenization; outputs then trail the device by one step
        and a stop string costs at most one discarded token.
        """
        plan = self.scheduler.schedule()
        self._read_plan(plan)
        if plan.num_tokens == 0:
            self.scheduler.update(np.zeros(0, np.int32))
            return self._process_text()
        outputs: list[RequestOutput] = []  # the overlapped text of the last step, if any
        try:
            lookahead = self._lookahead_steps(plan)
            if lookahead > 1:
                return self._run_lookahead(plan, lookahead, outputs)
            out = self._run(plan, outputs)
            events = self.scheduler.update(out.sampled_token_ids)
            outputs += self._record_events(events, out)
        except Exception as exc:  # one failed step fails its own requests only
            return outputs + self._fail_step(plan, exc)
        if not self.config.overlap_host_work:
            outputs += self._process_text()
        return outputs

    def _read_plan(self, plan: Any) -> None:
        """The plan's facts for the engine: seats the scheduler freed since the last
        plan, and requests scheduled for the first time (with their cache hits)."""
        for seat in plan.freed_seats.tolist():
            self.runner.free_request(seat)
        if len(plan.first_scheduled):
            now = time.monotonic()
            for handle, cached in zip(
                plan.first_scheduled.tolist(), plan.first_scheduled_cached.tolist(), strict=True
            ):
                request = self._by_handle.get(handle)
                if request is not None:
                    request.metrics.first_scheduled_time = now
                    request.num_cached_tokens = cached

    def _run(self, plan: Any, outputs: list[RequestOutput]) -> Any:
        """Load newly bound seats, dispatch the plan, and wait for its sampled tokens;
        with ``overlap_host_work`` the last step's text goes to ``outputs`` while the
        device runs."""
        self._bind_seats(plan)
        scoring = self._scoring_rows(plan) if self._scoring else {}
        targets = None
        if scoring:
            targets = step_prompt_targets(plan.num_tokens, plan.positions, plan.cu_q_lens, scoring)
        # Constrained rows: the runner enqueues the forward pass, then the Rust
        # core computes the grammar masks (GIL released) while the device runs it.
        constrained = bool(self._constrained) and self.scheduler.num_constrained_rows() > 0
        extra: dict[str, Any] = {}
        if constrained:
            extra["token_bitmask_fn"] = self._token_bitmask
        if targets is not None:
            extra["prompt_targets"] = targets
        # Plain steps call dispatch(plan) alone (test doubles take one argument).
        pending = self.runner.dispatch(plan, **extra)
        if constrained and self.runner.last_bitmask_overlapped:
            self.counters["structured_mask_hidden_steps"] += 1
        out = self._wait(pending, outputs)
        if targets is not None:
            self._record_prompt_scores(plan, scoring, out)
        return out

    def _wait(self, pending: Any, outputs: list[RequestOutput], num_steps: int = 1) -> Any:
        """The dispatched call's result; meanwhile (``overlap_host_work``) the last
        call's text goes to ``outputs``. Times the host gap before the call and the
        device time of each of its ``num_steps`` steps."""
        dispatched = self.runner.last_enqueue_time  # the device is busy from here
        if self._last_result_time is not None:
            self.timing.record_host_gap(dispatched - self._last_result_time)
        if self.config.overlap_host_work:
            outputs += self._process_text()
        result = pending.result()
        self._last_result_time = time.perf_counter()
        for _ in range(num_steps):
            self.timing.record_step((self._last_result_time - dispatched) / num_steps)
        return result

    def _lookahead_steps(self, plan: Any) -> int:
        """Decode steps this plan may run in one device call (multi-step scheduling,
        :mod:`kvpage.runner.multi_step`): more than 1 only for a plain decode step of
        few rows whose executable is compiled (else its compile is requested)."""
        steps = getattr(self.runner, "num_scheduler_steps", 1)  # test doubles: absent
        rows = int(plan.num_seqs)
        if steps <= 1 or not plan.decode_only or rows > self.runner.multi_step_max_rows:
            return 1
        if self._scoring or plan.sample_new_seat.any():
            return 1
        if not self.runner.multi_step_ready(rows):
            self.runner.prepare_multi_step(rows)
            return 1
        return int(self.scheduler.lookahead_steps(steps))

    def _run_lookahead(
        self, plan: Any, num_steps: int, outputs: list[RequestOutput]
    ) -> list[RequestOutput]:
        """Run ``plan`` and the next ``num_steps - 1`` decode steps in one device call,
        then apply each step's tokens as the scheduler replays those steps
        (``schedule_continuation``). Rows that finished meanwhile drop out; their later
        tokens are discarded. Returns ``outputs`` with this call's outputs appended."""
        try:
            return self._lookahead(plan, num_steps, outputs)
        except Exception as exc:  # fail the rows of the step being applied
            return outputs + self._fail_step(self._lookahead_plan, exc)

    def _lookahead(
        self, plan: Any, num_steps: int, outputs: list[RequestOutput]
    ) -> list[RequestOutput]:
        self._lookahead_plan = plan
        steps = self._wait(self.runner.dispatch_multi_step(plan, num_steps), outputs, num_steps)
        self.counters["multi_step_calls"] = self.counters.get("multi_step_calls", 0) + 1
        device_row = {int(seat): row for row, seat in enumerate(plan.sample_rows.tolist())}
        out = steps[0]
        for k in range(num_steps):
            if k > 0:
                if not self.scheduler.num_requests_running:
                    break
                plan = self._lookahead_plan = self.scheduler.schedule_continuation()
                self._read_plan(plan)
                if plan.num_tokens == 0:
                    self.scheduler.update(np.zeros(0, np.int32))
                    break
                out = steps[k].take([device_row[int(seat)] for seat in plan.sample_rows])
            events = self.scheduler.update(out.sampled_token_ids)
            outputs += self._record_events(events, out)
        if not self.config.overlap_host_work:
            outputs += self._process_text()
        return outputs

    def _record_events(self, events: tuple[np.ndarray, ...], out: Any) -> list[RequestOutput]:
        """Hand the step's sampled tokens to the output streams (text comes later,
        in ``_process_text``); returns the outputs of requests failed here."""
        handles, samples, tokens, codes, rows, stop_tokens = events
        self.counters["steps"] += 1
        logprobs = np.asarray(out.logprobs, np.float32)[rows]
        outputs = []
        finite = np.isfinite(logprobs)
        if not finite.all():  # NaN/inf logits: fail those requests only
            message = "the model produced non-finite logits for this request"
            for handle in dict.fromkeys(handles[~finite].tolist()):
                request = self._by_handle.get(handle)
                if request is not None:
                    outputs.append(self._fail_request(request, message))
            # Their cached blocks may hold the bad values: never reuse them.
            self.scheduler.reset_prefix_cache()
        now = time.monotonic()
        step = (handles, samples, tokens, codes, stop_tokens, logprobs, now, self.params_version)
        accepted = self._streams.push(*step)  # a failed request's streams are gone
        if self._python_streams:
            accepted |= self._python_streams.push(*step)
        self.counters["generation_tokens"] += int(np.count_nonzero(accepted))
        if self._logprob_handles:
            self._record_logprobs(handles, samples, tokens, rows, accepted, out)
        return outputs

    def _record_logprobs(
        self, handles: np.ndarray, samples: np.ndarray, tokens: np.ndarray, rows: np.ndarray,
        accepted: np.ndarray, out: Any,
    ) -> None:
        """Each accepted token's logprob dict, for the requests that asked for them."""
        wanted = accepted & np.isin(handles, np.fromiter(self._logprob_handles, np.uint64))
        for e in np.flatnonzero(wanted).tolist():
            request = self._by_handle[int(handles[e])]
            if request.logprob_arrays is not None:
                sample = int(samples[e])
                values = request.logprob_arrays.get(sample)
                if values is None:
                    values = request.logprob_arrays[sample] = array.array("f")
                values.append(out.logprobs[rows[e]])
                continue
            row, token = int(rows[e]), int(tokens[e])
            entry = {token: Logprob(float(out.logprobs[row]), int(out.ranks[row]))}
            k = request.params.logprobs or 0
            if k and out.top_token_ids is not None:
                top = zip(
                    out.top_token_ids[row][:k].tolist(), out.top_logprobs[row][:k].tolist(),
                    strict=True,
                )
                for rank, (tid, lp) in enumerate(top, start=1):
                    entry.setdefault(int(tid), Logprob(float(lp), rank))
            assert request.logprobs is not None
            request.logprobs.setdefault(int(samples[e]), []).append(entry)

    def _scoring_rows(self, plan: Any) -> dict[int, PromptLogprobsRecord]:
        """Plan rows whose request still has prompt tokens to score."""
        rows = {}
        for row, handle in enumerate(plan.row_request.tolist()):
            request = self._scoring.get(handle)
            if request is not None and request.prompt_scores is not None:
                rows[row] = request.prompt_scores
        return rows

    def _record_prompt_scores(
        self, plan: Any, rows: dict[int, PromptLogprobsRecord], out: Any
    ) -> None:
        cu = plan.cu_q_lens
        for row, record in rows.items():
            record.record(out, plan.positions, int(cu[row]), int(cu[row + 1]))
        for handle, request in list(self._scoring.items()):
            if request.prompt_scores is None or request.prompt_scores.complete:
                del self._scoring[handle]

    def _fail_step(self, plan: Any, exc: Exception) -> list[RequestOutput]:
        """A step raised: finish the requests it carried with an error, close
        the step in the scheduler, and drop the prefix cache (blocks cached
        for this step were never written). If the device KV pools were lost,
        every running request is failed and the pools are rebuilt."""
        message = f"the engine failed this request: {type(exc).__name__}: {exc}"
        # Not the request's fault (requests are validated on entry): a bug, logged whole.
        logger.error("step failed: %s", message, exc_info=exc)
        handles = set(plan.row_request.tolist()) | set(plan.sample_request.tolist())
        if self.runner.recover_device_state():  # every KV on the device is gone
            handles |= {
                r.handle
                for r in self._requests.values()
                if r.metrics.first_scheduled_time is not None
            }
        outputs = [
            self._fail_request(self._by_handle[h], message) for h in handles if h in self._by_handle
        ]
        if self.scheduler.awaiting_update:
            self.scheduler.update(np.zeros(plan.num_sampled, np.int32))
        self.scheduler.reset_prefix_cache()
        self.counters["failed_steps"] = self.counters.get("failed_steps", 0) + 1
        return outputs

    def _fail_request(self, request: _Request, message: str) -> RequestOutput:
        """Finish every sample of one request with an error; blocks return."""
        self.scheduler.finish_request(request.handle, "error")
        request.error = message
        return self._end_request(request, "error")

    def _process_text(self) -> list[RequestOutput]:
        """Text and stop strings of every new token, then the outputs of every
        request that progressed: one call each into the output streams."""
        outputs = []
        by_handle = self._by_handle
        for streams in (self._streams, self._python_streams):
            if not streams:
                continue
            for handle, index in streams.detokenize():
                self.scheduler.finish_sample(handle, index, "stop")
            for taken in streams.take_outputs():
                outputs.append(self._output(by_handle[taken[0]], taken))
        return outputs

    @property
    def token_decoder(self) -> TokenDecoder | None:
        """The Rust decoder of ``self.tokenizer`` (reloaded if the tokenizer is
        replaced): new requests stream through the Rust core's output streams, every
        sample of a step in one call. None: through their Python twin
        (:class:`PythonOutputStreams`), for tokenizers the Rust core cannot load, or
        with ``rust_detokenization`` off."""
        if not self.rust_detokenization or self.tokenizer is None:
            return None
        source, decoder = self._token_decoder
        if source is not self.tokenizer:
            decoder = rust_token_decoder(self.tokenizer)
            self._token_decoder = (self.tokenizer, decoder)
        return decoder

    def _bind_seats(self, plan: Any) -> None:
        """Load each newly bound seat of the plan with its sample's sampling
        parameters and token history (the scheduler chose the seat)."""
        if not plan.sample_new_seat.any():
            return
        for row in np.flatnonzero(plan.sample_new_seat).tolist():
            handle, index = int(plan.sample_request[row]), int(plan.sample_index[row])
            request = self._by_handle[handle]
            tokens = self.scheduler.sample_tokens(handle, index)
            device_params = request.params.device_params(self.eos_token_ids)
            if device_params.seed is not None and index > 0:
                # Seeded samples of one request differ from each other but replay exactly.
                device_params.seed = (device_params.seed * 0x9E3779B97F4A7C15 + index) % (1 << 63)
            self.runner.set_request(
                int(plan.sample_rows[row]), device_params, request.prompt_token_ids,
                tokens[len(request.prompt_token_ids) :],
            )

    def _add_streams(
        self, handle: int, prompt: list[int], params: SamplingParams, *, delta: bool,
        final_only: bool,
    ) -> OutputStreams | PythonOutputStreams:
        """Open the request's output streams: in the Rust core, unless its tokenizer
        can only detokenize in Python."""
        mode = "final" if final_only else "delta" if delta else "cumulative"
        decoder: Any = self.token_decoder
        streams: OutputStreams | PythonOutputStreams = self._streams
        if decoder is None and self.tokenizer is not None:
            if self._python_streams is None:
                self._python_streams = PythonOutputStreams(CompletionOutput)
            streams, decoder = self._python_streams, self.tokenizer
        text = {}
        if decoder is not None:
            text = {
                "decoder": decoder,
                "prompt_token_ids": prompt[-_PROMPT_CONTEXT_TOKENS:],
                "stop": list(params.stop_strings),
                "include_stop_str_in_output": params.include_stop_str_in_output,
                "skip_special_tokens": params.skip_special_tokens,
                # A sample these finish shows no text for them (vLLM's rule).
                "stop_token_ids": sorted({*self.eos_token_ids, *params.stop_token_ids}),
            }
        streams.add_request(handle, params.n, mode, logprobs=params.logprobs is not None, **text)
        return streams

    def _end_request(self, request: _Request, reason: str) -> RequestOutput:
        """The last output of a request ended from outside (abort, error)."""
        request.streams.finish_request(request.handle, reason)
        taken = request.streams.take_request(request.handle)
        assert taken is not None and taken[1], "a live request has streams"
        return self._output(request, taken)

    def _output(self, request: _Request, taken: OutputTuple) -> RequestOutput:
        """A ``RequestOutput`` from what the request's streams handed out."""
        _, done, first_token_time, last_token_time, completions = taken
        metrics = request.metrics
        metrics.first_token_time = first_token_time
        metrics.last_token_time = last_token_time
        if request.logprobs is not None:
            self._attach_logprobs(request, completions)
        elif request.logprob_arrays is not None:
            for completion in completions:
                values = request.logprob_arrays.get(completion.index, array.array("f"))
                completion.logprob_array = np.frombuffer(values, np.float32).copy()
        if done:
            self._retire(request, completions)
        prompt_logprobs = scored = None
        scores = request.prompt_scores
        if scores is not None and scores.complete:
            if request.score_from is not None:
                scored = scores.logprobs_from(request.score_from)
            elif not (request.delta and request.prompt_logprobs_sent):
                prompt_logprobs = scores.build()
            request.prompt_logprobs_sent = True
        return RequestOutput(
            request.request_id, request.prompt, request.prompt_token_ids, completions, done,
            metrics, request.num_cached_tokens, request.error, prompt_logprobs, scored,
        )

    @staticmethod
    def _attach_logprobs(request: _Request, completions: list[CompletionOutput]) -> None:
        """Each completion's logprob dicts, for the tokens it carries."""
        assert request.logprobs is not None
        for completion in completions:
            entries = request.logprobs.get(completion.index, [])
            start = request.logprobs_sent.get(completion.index, 0) if request.delta else 0
            end = start + len(completion.token_ids)
            completion.logprobs = entries[start:end]
            request.logprobs_sent[completion.index] = end

    def _retire(self, request: _Request, completions: list[CompletionOutput]) -> None:
        """Forget a request whose last output is being made."""
        request.finished = True
        request.metrics.finished_time = time.monotonic()
        self._requests.pop(request.request_id, None)
        self._by_handle.pop(request.handle, None)
        self._constrained.discard(request.handle)
        self._scoring.pop(request.handle, None)
        self._logprob_handles.discard(request.handle)
        for completion in completions:
            key = completion.finish_reason or "abort"
            self.finished_counts[key] = self.finished_counts.get(key, 0) + 1

    # ---- live weights ---------------------------------------------------

    def update_params(self, params: Any) -> int:
        """Swap in new weights between steps (a step boundary) and return the
        new params version. The tree must match the old one in structure,
        shapes and dtypes, else ValueError and the old weights stay live.
        The KV pool stays allocated and nothing recompiles; the prefix cache
        is dropped (its KV came from the old weights). Tokens produced from
        now on carry the new version in ``CompletionOutput.params_versions``."""
        self.runner.update_params(params)
        self.scheduler.reset_prefix_cache()
        self.params_version += 1
        return self.params_version

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's name): blocks no sequence holds return to
        the pool, and running sequences keep their blocks but stop caching them. For
        callers whose prompts change wholesale, e.g. an RL loop between steps;
        ``update_params`` does it already. Returns True, as vLLM's does on success."""
        self.scheduler.reset_prefix_cache()
        return True

    # ---- introspection --------------------------------------------------

    def get_stats(self) -> dict[str, Any]:
        """Scheduler counters plus engine token totals (cheap: every step)."""
        stats = dict(self.scheduler.stats())
        stats["prompt_tokens_total"] = self.counters["prompt_tokens"]
        stats["generation_tokens_total"] = self.counters["generation_tokens"]
        stats["request_success_total"] = dict(self.finished_counts)
        stats["num_unfinished_requests"] = len(self._requests)
        stats["timing"] = self.timing.as_dict()
        stats["step_executables_pending"] = self.step_executables_pending()
        return stats

    def step_executables_pending(self) -> int:
        """Step executables the background warm-up has not built yet (any thread)."""
        background = self.runner.background_compiler
        return 0 if background is None else background.pending

    def check_invariants(self) -> None:
        """Raise if the KV pool or scheduler state is inconsistent."""
        self.scheduler.check_invariants()  # seats included: the scheduler owns them
