"""The engine loop: the Rust scheduler plans a step, the runner runs it, the scheduler
applies the sampled tokens, and the engine turns tokens into text, stop strings and
``RequestOutput``s.

    engine = LLMEngine.from_config(EngineConfig(model=path))
    engine.add_request("r1", "Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for out in engine.step(): ...

Ownership (issue #17): the Rust scheduler owns every fact about a request's progress
-- seats, finish codes and stop tokens, first schedules and prefix-cache hits -- and
the engine only reads them from the step plan and ``update``; the Rust core's
``OutputStreams`` own what a client is handed. The engine adds only what the scheduler
cannot see (stop strings, found in the text, and failures).

Ids: the engine maps ``request_id`` (str) to the scheduler's ``handle``; a sample is
``(handle, sample index)``. The id spaces are documented in ``rust/sched/request.rs``;
the runner's (seats, blocks, slots) in :mod:`kvpage.runner.protocol`.

``LLMEngine`` builds the stages of a step and owns none of their state; each is a
module of this package:

- ``intake``: a new request's checks and admission (``add_request``);
- ``requests``: the live requests, by id and by handle;
- ``plan_reader``: what a plan asks before it runs (seats freed and bound, first
  schedules);
- ``scoring`` and ``structured``: prompt logprobs and grammar masks of a step;
- ``timing``: the wait for the device, and where a step's time goes;
- ``update``: the sampled tokens, applied (``logprobs``: their logprobs, recorded);
- ``outputs``: the output streams and the ``RequestOutput``s made from them;
- ``lookahead``: several decode steps in one device call;
- ``draft_model``: drafts from a smaller model (speculative method ``"draft_model"``);
- ``failures``: a failed step or non-finite logits fail their own requests only;
- ``loading`` and ``context``: what the engine is built from, and what its stages
  share.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvpage._core import Scheduler, TokenDecoder, set_cpu_input_bits
from kvpage.engine.config import EngineConfig
from kvpage.engine.context import EngineContext
from kvpage.engine.draft_model import DraftModelProposer, draft_engine_config
from kvpage.engine.failures import Failures
from kvpage.engine.intake import PromptType, QueueFullError, RequestIntake
from kvpage.engine.kv_events import KVEventPublisher
from kvpage.engine.loading import (
    build_model_runner,
    load_model_and_tokenizer,
    load_tokenizer,
    merge_eos_ids,
    pack_weights_for_host,
)
from kvpage.engine.logprobs import SampledLogprobs
from kvpage.engine.lookahead import MultiStepDecode
from kvpage.engine.outputs import EngineOutputs
from kvpage.engine.plan_reader import PlanReader
from kvpage.engine.requests import RequestTable
from kvpage.engine.scoring import PromptScoring
from kvpage.engine.structured import StructuredOutputs
from kvpage.engine.timing import DeviceWait, StepTiming
from kvpage.engine.update import StepUpdate
from kvpage.lora.adapter import LoRAAdapter
from kvpage.lora.request import LoRARequest
from kvpage.lora.slots import LoRASlots
from kvpage.model.config import ModelConfig
from kvpage.model.tokenizer_cache import TOKENIZER_DIR_NAME
from kvpage.outputs import RequestOutput
from kvpage.sampling.params import SamplingParams
from kvpage.system.compilation_cache import cache_dir, compile_counts, enable_compilation_cache

if TYPE_CHECKING:
    from kvpage._core import StepPlan
    from kvpage.runner.protocol import StepRunner
    from kvpage.runner.step_output import StepOutput
    from kvpage.structured_outputs.compiler import GrammarCompiler

__all__ = [
    "LLMEngine", "PromptType", "QueueFullError", "StepTiming", "load_model_and_tokenizer",
    "load_tokenizer",
]


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
        runner: StepRunner | None = None,
        mesh: Any = None,
    ) -> None:
        """``runner`` replaces the JAX ``ModelRunner`` over ``params`` with any
        :class:`~kvpage.runner.protocol.StepRunner` (``kvpage.bench.host`` passes an
        instant token source). ``mesh``: a ``jax.sharding.Mesh`` with a ``"tp"`` axis
        to run on (a trainer's own mesh: weights and KV heads split over ``"tp"``,
        replicated over its other axes) instead of ``tensor_parallel_size`` devices."""
        self.config = config
        self.model_config = model_config
        self.max_model_len = config.resolve_max_model_len(model_config.max_position_embeddings)
        self.compilation_cache_dir = enable_compilation_cache(config.compilation_cache_dir)
        set_cpu_input_bits(config.cpu_input_bits)  # process-wide (EngineConfig)
        compiles_before = compile_counts()
        self.kv_cache_dtype = config.kv_cache_dtype
        """The KV pools' element type (what ``"auto"`` resolved to, when the engine built
        its runner)."""
        if runner is None:
            model_runner = build_model_runner(
                config, model_config, params, self.max_model_len, mesh
            )
            runner, self.kv_cache_dtype = model_runner, model_runner.kv_spec.dtype
        self.eos_token_ids = merge_eos_ids(model_config, model_dir, tokenizer)
        scheduler = Scheduler(
            runner.num_blocks,
            config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.step_token_budget(self.max_model_len),
            max_model_len=self.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            enable_prefix_caching=config.enable_prefix_caching,
            group_shared_prefills=config.group_shared_prefills,
            scheduling_policy=config.scheduling_policy,
            eos_token_ids=self.eos_token_ids,
            # Every layer slides: blocks that leave the window go back to the pool (the
            # kernels never read before a sliding layer's window).
            sliding_window=(
                model_config.sliding_window
                if model_config.all_layers_slide and config.scheduling_policy != "static"
                else None
            ),
            **(spec.scheduler_args() if (spec := config.speculative_config) else {}),
        )
        ctx = self._ctx = EngineContext(
            config, model_config, self.max_model_len, self.eos_token_ids, runner, scheduler,
            tokenizer,
        )
        self.counters = ctx.counters
        requests = self._requests = RequestTable()
        self.lora: LoRASlots | None = LoRASlots(runner) if config.enable_lora else None
        """Which LoRA adapter sits in which slot (``enable_lora``)."""
        requests.lora = self.lora
        logprobs = SampledLogprobs(requests)
        self._outputs = EngineOutputs(ctx, requests, logprobs)
        self._structured = StructuredOutputs(ctx, requests)
        self._scoring = PromptScoring(ctx, requests)
        self._intake = RequestIntake(
            ctx, requests, self._outputs, logprobs, self._scoring, self._structured
        )
        self._plans = PlanReader(ctx, requests)
        self._device = DeviceWait(ctx, self._outputs)
        self._failures = Failures(ctx, requests, self._outputs)
        self._update = StepUpdate(ctx, requests, self._outputs, logprobs, self._failures)
        self._multi_step = MultiStepDecode(
            ctx, requests, self._plans, self._device, self._update, self._outputs,
            self._failures,
        )
        self.draft_model: DraftModelProposer | None = None
        """The draft model's engine driver (speculative method ``"draft_model"``)."""
        spec = config.speculative_config
        if spec is not None and spec.method == "draft_model":
            draft = LLMEngine.from_config(draft_engine_config(config, self.max_model_len))
            self.draft_model = DraftModelProposer(draft, model_config, str(spec.model))
        self.kv_events: KVEventPublisher | None = None
        """The prefix cache's events on ZMQ (``kv_events_config``), else None."""
        if (events := config.kv_events_config) is not None and events.active:
            if not config.enable_prefix_caching:
                raise ValueError("kv_events_config publishes prefix-cache events: it needs "
                                 "enable_prefix_caching")
            scheduler.enable_kv_events()
            self.kv_events = KVEventPublisher(events, config.block_size)
        if config.warmup == "full":
            runner.warmup(progress=True)
        elif config.warmup == "background":
            runner.start_background_compile()
        self.startup_compiles = compile_counts() - compiles_before
        """Executables XLA compiled (and loaded from the persistent cache) while this
        engine started; with ``warmup="background"`` the rest follow on their thread."""

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
        pack_weights_for_host(config, model_config, params, tensor_parallel_size, mesh)
        return cls(config, model_config, params, tokenizer, model_dir, mesh=mesh)

    # ---- what the stages share (replaceable: a spy scheduler, another tokenizer) ----

    @property
    def runner(self) -> StepRunner:
        return self._ctx.runner

    @property
    def scheduler(self) -> Scheduler:
        return self._ctx.scheduler

    @scheduler.setter
    def scheduler(self, scheduler: Scheduler) -> None:
        self._ctx.scheduler = scheduler

    @property
    def tokenizer(self) -> Any:
        return self._ctx.tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer: Any) -> None:
        self._ctx.tokenizer = tokenizer

    @property
    def params_version(self) -> int:
        """The weights' version: 0, then one more per ``update_params``."""
        return self._ctx.params_version

    @property
    def timing(self) -> StepTiming:
        """Where the steps' wall time went (device vs host gap)."""
        return self._device.timing

    @timing.setter
    def timing(self, timing: StepTiming) -> None:
        self._device.timing = timing

    @property
    def rust_detokenization(self) -> bool:
        """Stream new requests' outputs through the Rust core's ``OutputStreams`` when
        it can load the tokenizer (False: through their Python twin)."""
        return self._outputs.rust_detokenization

    @rust_detokenization.setter
    def rust_detokenization(self, value: bool) -> None:
        self._outputs.rust_detokenization = value

    @property
    def token_decoder(self) -> TokenDecoder | None:
        """The Rust decoder of ``tokenizer`` new requests stream through (None: they
        stream through the Python twin)."""
        return self._outputs.token_decoder

    @property
    def finished_counts(self) -> dict[str, int]:
        """Finished samples by finish reason."""
        return self._outputs.finished_counts

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """Compiles structured-output constraints for this model (created on first use;
        the server calls it off the event loop before ``add_request``)."""
        return self._structured.compiler

    # ---- requests -------------------------------------------------------

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
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request. Raises ValueError naming what is wrong with it,
        or QueueFullError when the waiting queue is at its bound.

        ``score_from`` (with ``params.prompt_logprobs``): score only the prompt tokens
        from that index on; the prefix cache may still supply the positions before it
        (a shared prompt is computed once for all the completions scored after it).
        ``logprobs_as_arrays`` (with ``params.logprobs == 0``): each sample's sampled
        logprobs come back as one float32 array, ``CompletionOutput.logprob_array``.
        ``lora_request``: run under that LoRA adapter (needs ``enable_lora``)."""
        self._intake.add(
            request_id, prompt, params, priority, cache_salt, delta=delta,
            final_only=final_only, arrival_time=arrival_time, score_from=score_from,
            logprobs_as_arrays=logprobs_as_arrays, lora_request=lora_request,
        )

    def abort_request(self, request_ids: str | Sequence[str]) -> list[RequestOutput]:
        """Abort requests in any state; their blocks return at once."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        outputs = []
        for request_id in ids:
            request = self._requests.get(request_id)
            if request is None:
                continue
            self.scheduler.abort_request(request.handle)
            outputs.append(self._outputs.end(request, "abort"))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    def request_ids(self) -> list[str]:
        """The ids of the unfinished requests, oldest first."""
        return list(self._requests)

    # ---- one step -------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns the requests that progressed.

        With ``overlap_host_work`` (the default), the text of step t's tokens
        is produced while the device runs step t + 1, so the device does not
        wait for detokenization; outputs then trail the device by one step
        and a stop string costs at most one discarded token. With KV-cache events
        on, what the step cached and evicted is published after it.
        """
        outputs = self._step()
        if self.kv_events is not None:
            self.kv_events.publish(self.scheduler.take_kv_events())
        return outputs

    def set_overlapped_output_sink(
        self, sink: Callable[[list[RequestOutput]], None] | None
    ) -> None:
        """With ``overlap_host_work``, when the next device call runs several decode
        steps (multi-step decode), hand the outputs of the last call to ``sink`` as soon
        as they are made, while that call runs, instead of returning them from the
        ``step()`` that waits for it (None: return them). A stream then sees its tokens
        eight steps sooner, a prompt's first token included (SmolLM2 served, 20-token
        requests, 2026-11-28: first chunk 59-72 -> 31-41 ms after the request).
        One-step calls keep returning them: there the lag is one step, and on a 2-core
        host the event loop's work for 32 streams during the call cost ~6 % of
        throughput. ``sink`` runs on the thread calling ``step()``; what it gets is
        never returned by ``step()`` too."""
        self._device.sink = sink

    def _step(self) -> list[RequestOutput]:
        if self.draft_model is not None:
            self.draft_model.propose(self.scheduler)
        plan = self.scheduler.schedule()
        self._plans.read(plan)
        if plan.num_tokens == 0:
            self.scheduler.update(np.zeros(0, np.int32))
            return self._outputs.process_text()
        outputs: list[RequestOutput] = []  # the overlapped text of the last step, if any
        try:
            num_steps = self._multi_step.steps(plan)
            if num_steps > 1:  # run and update several decode steps
                return self._multi_step.run(plan, num_steps, outputs)
            out = self._run(plan, outputs)
            outputs += self._update.apply(out)
        except Exception as exc:  # one failed step fails its own requests only
            return outputs + self._failures.fail_step(plan, exc)
        if not self.config.overlap_host_work:
            outputs += self._outputs.process_text()
        return outputs

    def _run(self, plan: StepPlan, outputs: list[RequestOutput]) -> StepOutput:
        """Load newly bound seats, dispatch the plan, and wait for its sampled tokens;
        with ``overlap_host_work`` the last step's text goes to ``outputs`` while the
        device runs."""
        self._plans.bind_seats(plan)
        scoring = self._scoring.rows(plan)
        targets = self._scoring.targets(plan, scoring)
        # Constrained rows: the runner enqueues the forward pass, then the Rust core
        # computes the grammar masks (GIL released) while the device runs it.
        bitmask_fn = self._structured.bitmask_fn()
        runner = self.runner
        pending = runner.dispatch(plan, prompt_targets=targets, token_bitmask_fn=bitmask_fn)
        if bitmask_fn is not None and runner.last_bitmask_overlapped:
            self.counters["structured_mask_hidden_steps"] += 1
        out: StepOutput = self._device.wait(pending, outputs)
        if targets is not None:
            self._scoring.record(plan, scoring, out)
        return out

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
        self._ctx.params_version += 1
        return self._ctx.params_version

    def update_lora(self, lora_request: LoRARequest, adapter: LoRAAdapter) -> int:
        """New weights for adapter ``lora_request`` (an RL policy's adapter) between steps;
        returns the new params version, as :meth:`update_params` (the base stays).
        Prompts cached under the adapter's old weights are not reused. Raises ValueError
        while requests run under the adapter."""
        if self.lora is None:
            raise ValueError("update_lora needs an engine built with enable_lora=True")
        self.lora.add_adapter(lora_request, adapter)
        self._ctx.params_version += 1
        return self._ctx.params_version

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
