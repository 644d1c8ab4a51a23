"""The model runner: runs the scheduler's step plans on the device(s).

This file owns :class:`ModelRunner`, the facade the engine drives (its interface:
:class:`kvpage.runner.protocol.StepRunner`): construction (checks, placement, KV-cache
sizing, buckets), the state every step reads and donates -- the params, the paged KV
pools, the sampling table (one row per seat), the step counter -- the live weight swap
(:meth:`~ModelRunner.update_params`) and the recovery of donated buffers after a failed
step (:meth:`~ModelRunner.recover_device_state`). Each job of a step is a collaborator of
its own, which the facade delegates to:

* :class:`~kvpage.runner.placement.Placement` (``placement``) -- where arrays live: one
  device, or sharded over a tensor-parallel mesh;
* :class:`~kvpage.runner.step_executables.StepExecutables` (``executables``) -- the
  bucket policy, building and caching every executable (also across starts), the
  warm-up and the background compile with its fallback to a larger bucket;
* :class:`~kvpage.runner.seats.Seats` (``seats``) -- :meth:`~ModelRunner.set_request` and
  :meth:`~ModelRunner.free_request`, the sampling-table writes;
* :func:`~kvpage.runner.plan_check.check_plan` -- a plan's range checks;
* :class:`~kvpage.runner.step_dispatch.StepDispatch` (``steps``) --
  :meth:`~ModelRunner.dispatch`: pack the plan into one buffer, then enqueue the bucket's
  pieces (embed -> layer groups -> select -> head: :mod:`kvpage.runner.layered_step`);
* :class:`~kvpage.runner.multi_step_decode.MultiStepDecode` (``multi_step``) --
  :meth:`~ModelRunner.dispatch_multi_step`: several decode steps in one device call;
* :mod:`kvpage.runner.pending` -- the dispatched calls' results, copied to the host on
  ``result()``.

With ``tensor_parallel_size=N`` (or an explicit ``mesh``) the same step runs over N devices
(:mod:`kvpage.runner.tensor_parallel`): params split Megatron-style, KV pools split by KV
head, the attention kernel per shard under ``shard_map``; the packed step inputs, the
sampling table and the sampled outputs are replicated, so every device (and host) sees the
same tokens.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from kvpage.lora.adapter import LoRAAdapter
from kvpage.lora.stacks import LoRAStacks, stacks_dtype
from kvpage.model.attention import get_attention_backend
from kvpage.model.config import ModelConfig
from kvpage.model.params import Params, check_same_layout, validate_params
from kvpage.runner.background_compiler import BackgroundCompiler
from kvpage.runner.buckets import default_buckets, normalize_buckets
from kvpage.runner.kv_cache import KVPools, allocate_kv_cache, pool_bytes_on
from kvpage.runner.kv_cache_sizing import size_kv_cache
from kvpage.runner.layered_step import is_stacked, layer_plan, layer_signature
from kvpage.runner.multi_step import MULTI_STEP_MAX_ROWS, default_scheduler_steps
from kvpage.runner.multi_step_decode import MultiStepDecode
from kvpage.runner.pending import PendingMultiStep, PendingStep
from kvpage.runner.placement import Placement
from kvpage.runner.plan_check import check_plan
from kvpage.runner.seats import Seats
from kvpage.runner.step_dispatch import StepDispatch
from kvpage.runner.step_executables import StepExecutables
from kvpage.runner.step_inputs import PaddingValues
from kvpage.runner.step_output import StepOutput
from kvpage.runner.step_plan import StepPlanLike
from kvpage.runner.tensor_parallel import (
    check_tensor_parallel,
    make_mesh,
    mesh_size,
    place,
    shard_attention_backend,
)
from kvpage.sampling.device_params import DeviceSamplingParams
from kvpage.sampling.table import SamplingTable, init_sampling_table


class ModelRunner:
    """Owns the params, the paged KV pools and the per-seat sampling state on the device(s).

    Args:
        config: the model's :class:`ModelConfig`.
        params: parameter pytree (:mod:`kvpage.model.params` layout); validated and placed
            on ``device`` (or sharded over the mesh). Leaves that are already there, as jax
            arrays of the right sharding, are adopted as they are (no copy). Swap later
            with :meth:`update_params`.
        num_blocks: KV blocks the Rust block pool manages (the device pool gets one more,
            the scratch block). ``None``: decided by
            :func:`kvpage.runner.kv_cache_sizing.decide_num_blocks` from
            ``kv_cache_memory`` or the device's (host's) memory.
        block_size: tokens per KV block.
        max_model_len: longest sequence (prompt + output); fixes the block-table width.
        attention_backend: ``None``/``"reference"`` or a ``kvpage.kernels`` backend name.
        max_num_seqs: seats of the sampling table; ``sample_rows`` index them.
        max_sampled_rows: most sampled rows a step carries (default ``max_num_seqs``;
            more with speculative decoding: one sequence verifying its drafts).
        max_num_batched_tokens: most tokens in one step.
        token_buckets / seq_buckets: padded sizes for T and max(S, S'); default powers
            of two up to the maxima (policy: :mod:`kvpage.runner.buckets`).
        max_token_seq_ratio: a step padded to T tokens gets at least ``T / ratio`` padded
            sequence rows, which bounds the number of (T, S) bucket pairs to compile at
            the price of a few extra padded rows (cheap) in large steps.
        max_fused_copies: CoW copies executed inside the step; plans with more run them
            in a separate call before the step.
        kv_cache_dtype: dtype of the pools; None or ``"auto"``: :func:`resolve_kv_cache_dtype`.
        kv_memory_fraction: share of an accelerator's memory for params + cache + steps
            (``gpu_memory_utilization``).
        kv_cache_memory: bytes for the KV cache (overrides the memory-based sizing).
        max_logprobs: width of the top-N logprob lists (0 disables them).
        enable_penalties: keep per-seat token histories ([seats, vocab] on device) so
            presence/frequency/repetition penalties work.
        seed: base seed for requests without their own seed.
        validate_plans: range-check every plan on the host (cheap numpy checks).
        tensor_parallel_size: shard the model over this many devices (the first N of
            :func:`jax.devices`); must divide the query and KV head counts.
        mesh: an explicit mesh with a ``"tp"`` axis instead (overrides the size).
        num_scheduler_steps: most decode steps one device call may run
            (:mod:`kvpage.runner.multi_step`); 1 runs every step on its own; None:
            :func:`default_scheduler_steps`.
        enable_lora: give every adaptable projection LoRA stacks of ``max_loras`` slots
            of rank up to ``max_lora_rank`` (:mod:`kvpage.lora.stacks`), filled by
            :meth:`load_lora`; each step's rows use their request's slot.
        batch_invariant: trace every step with kernels whose result for a token does
            not depend on the step's other rows (``linear_kernels.batch_invariant``):
            CPU, one device, float32 or GGUF-quantized weights.
    """

    def __init__(
        self,
        config: ModelConfig,
        params: Params,
        num_blocks: int | None,
        block_size: int,
        max_model_len: int,
        attention_backend: str | None = None,
        *,
        max_num_seqs: int = 256,
        max_sampled_rows: int | None = None,
        max_num_batched_tokens: int = 2048,
        token_buckets: Sequence[int] | None = None,
        seq_buckets: Sequence[int] | None = None,
        max_token_seq_ratio: int = 16,
        max_fused_copies: int = 8,
        kv_cache_dtype: str | None = None,
        kv_memory_fraction: float = 0.9,
        kv_cache_memory: int | None = None,
        max_logprobs: int = 20,
        enable_penalties: bool = True,
        seed: int = 0,
        device: jax.Device | None = None,
        validate_plans: bool = True,
        tensor_parallel_size: int = 1,
        mesh: Mesh | None = None,
        num_scheduler_steps: int | None = None,
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        batch_invariant: bool = False,
    ) -> None:
        if max_model_len <= 0 or block_size <= 0:
            raise ValueError("max_model_len and block_size must be positive")
        if max_model_len > config.max_position_embeddings:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
                f"{config.max_position_embeddings}"
            )
        if mesh is None and tensor_parallel_size > 1:
            check_tensor_parallel(config, tensor_parallel_size)
            mesh = make_mesh(tensor_parallel_size)
        tp = mesh_size(mesh) if mesh is not None else 1
        check_tensor_parallel(config, tp)
        self.config = config
        self.mesh = mesh
        self.tensor_parallel_size = tp
        self.device = device or (
            mesh.devices.flat[0] if mesh is not None else jax.local_devices()[0]
        )
        self.backend = get_attention_backend(attention_backend)
        validate_params(config, params)
        if batch_invariant and (mesh is not None or self.device.platform != "cpu"):
            raise ValueError("batch_invariant runs on one CPU device only (its kernels are "
                             "the Rust host kernels)")
        self.batch_invariant = batch_invariant
        self.lora: LoRAStacks | None = None
        """The adapter stacks (:mod:`kvpage.lora.stacks`) with ``enable_lora``."""
        if enable_lora:
            if mesh is not None:
                raise ValueError("LoRA adapters are not supported with tensor parallelism yet")
            self.lora = LoRAStacks(max_loras, max_lora_rank)
            params = self.lora.attach(params, stacks_dtype(params))
        if mesh is not None:
            self.backend = shard_attention_backend(self.backend, mesh)
        self.placement = Placement(config, params, mesh, self.device)
        self.params: Params
        self.params, self.last_update_copies = place(params, self.placement.param_shardings)
        self.kv_spec, self.kv_cache_decision = size_kv_cache(
            config, self.params, kv_cache_dtype, block_size, tp, self.device,
            num_blocks=num_blocks, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, kv_cache_memory=kv_cache_memory,
            memory_utilization=kv_memory_fraction,
        )
        num_blocks = self.kv_spec.num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = math.ceil(max_model_len / block_size)
        self.max_num_seqs = max_num_seqs
        self.max_sampled_rows = max(max_num_seqs, max_sampled_rows or 0)
        self.max_logprobs = max_logprobs
        self.max_fused_copies = max_fused_copies
        self.max_token_seq_ratio = max_token_seq_ratio
        self.enable_penalties = enable_penalties
        self.validate_plans = validate_plans
        if num_scheduler_steps is None:
            num_scheduler_steps = default_scheduler_steps(self.device.platform, mesh, params)
        if num_scheduler_steps < 1:
            raise ValueError(f"num_scheduler_steps must be >= 1; got {num_scheduler_steps}")
        self.num_scheduler_steps = num_scheduler_steps
        self.multi_step_max_rows = MULTI_STEP_MAX_ROWS
        """Decode steps of up to this many rows may run several steps per call."""

        platform = self.device.platform
        self.token_buckets = normalize_buckets(
            token_buckets or default_buckets(platform, max_num_batched_tokens, "tokens"),
            "token_buckets",
        )
        self.seq_buckets = normalize_buckets(
            seq_buckets or default_buckets(platform, self.max_sampled_rows, "seqs"),
            "seq_buckets",
        )
        self.padding = PaddingValues(
            scratch_slot=self.kv_spec.scratch_slot,
            scratch_block=self.kv_spec.scratch_block,
            dummy_sample_row=max_num_seqs,
            dropped_block=num_blocks + 1,
        )

        self.kv_pools: KVPools = allocate_kv_cache(self.kv_spec, self.placement.pool_sharding)
        self.sampling_table: SamplingTable = init_sampling_table(
            max_num_seqs, config.vocab_size, enable_penalties, self.placement.replicated
        )
        self.seed = seed
        self.step_counter = 0

        self.last_enqueue_time = 0.0
        """``time.perf_counter()`` when the last step's device work was enqueued (with
        overlapped masks: the forward pass, before the masks are computed)."""
        self.last_bitmask_overlapped = False
        """Whether the forward pass was still running when the last step's
        ``token_bitmask_fn`` returned (its host work hidden behind the device)."""
        self.stacked = is_stacked(self.params)
        self.layer_plan = layer_plan(
            [config.layer_type(i) for i in range(config.num_layers)] if self.stacked
            else [
                layer_signature(layer, config.layer_type(i))
                for i, layer in enumerate(self.params["layers"])
            ]
        )
        # Executables of earlier starts are not used with a mesh, whose executables are
        # placed on several devices.
        self.executables = StepExecutables(self, self.placement, use_store=mesh is None)
        self.seats = Seats(self, self.executables, self.placement)
        self.steps = StepDispatch(self, self.executables, self.placement)
        self.multi_step = MultiStepDecode(self, self.executables)

    # ------------------------------------------------------------------ properties
    @property
    def num_blocks(self) -> int:
        """Blocks for the Rust block pool (ids ``0 .. num_blocks - 1``; scratch excluded)."""
        return self.kv_spec.num_blocks

    @property
    def kv_cache_bytes_per_device(self) -> int:
        """Bytes of KV pools (all layers, K and V) held on the first device of the mesh."""
        return pool_bytes_on(self.kv_pools, self.device)

    # ------------------------------------------------------------------ start-up
    # (the StepRunner protocol; the rest of the bucket and warm-up API is
    # ``self.executables``, of multi-step decode ``self.multi_step``)
    @property
    def background_compiler(self) -> BackgroundCompiler | None:
        return self.executables.background_compiler

    def warmup(self, progress: bool = True, max_workers: int = 1) -> None:
        """Compile every executable a step may need (``warmup="full"``)."""
        multi = [functools.partial(self.multi_step.multi_step_fn, s)
                 for s in self.multi_step.buckets()]
        self.executables.warmup(progress, max_workers, multi)

    def start_background_compile(self) -> BackgroundCompiler:
        return self.executables.start_background_compile()

    def multi_step_ready(self, num_rows: int) -> bool:
        return self.multi_step.ready(num_rows)

    def prepare_multi_step(self, num_rows: int) -> None:
        self.multi_step.prepare(num_rows)

    def dispatch_multi_step(self, plan: StepPlanLike, num_steps: int) -> PendingMultiStep:
        return self.multi_step.dispatch(plan, num_steps)

    # ------------------------------------------------------------------ seats
    def set_request(
        self,
        seat: int,
        params: DeviceSamplingParams,
        prompt_token_ids: Sequence[int] | np.ndarray = (),
        output_token_ids: Sequence[int] | np.ndarray = (),
    ) -> None:
        """Bind ``seat`` to a request's ``params`` before its first sampled step.

        Call again on resume after preemption (with the tokens generated so far) or to
        change the parameters; it never recompiles. The histories feed the penalties,
        and ``len(output_token_ids)`` is the index of the next generated token (seeded keys).
        """
        self.seats.set_request(seat, params, prompt_token_ids, output_token_ids)

    def free_request(self, seat: int) -> None:
        """Forget a finished request's host-side flags (its device row is simply reused)."""
        self.seats.free_request(seat)

    # ------------------------------------------------------------------ params and device state
    def update_params(self, params: Params) -> int:
        """Swap in new weights of identical tree structure, shapes and dtypes.

        Nothing recompiles and the KV pools stay as they are (their contents now
        describe the old weights: the caller decides what to drop). Leaves that already
        are jax arrays with this runner's sharding (one device, or the tensor-parallel
        layout of :func:`~kvpage.runner.tensor_parallel.shard_params`) are adopted as they
        are; others are transferred (device to device where possible). Raises ValueError naming the
        first mismatch, before anything changes: the old params stay live. Returns the
        number of leaves that had to be transferred (0: nothing was copied).
        """
        validate_params(self.config, params)
        if self.lora is not None:  # the resident adapters stay
            params = self.lora.attach(params, None, like=self.params)
        check_same_layout(self.params, params)
        self.params, self.last_update_copies = place(params, self.placement.param_shardings)
        return self.last_update_copies

    def load_lora(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Write ``adapter`` (None: zeros) into adapter slot ``slot`` of every stack (new
        arrays swapped in by reference; nothing recompiles). Needs ``enable_lora``."""
        if self.lora is None:
            raise ValueError("this runner was built without enable_lora")
        self.params = self.lora.write(self.params, slot, adapter)

    def base_params(self) -> Params:
        """The params tree without the LoRA stacks (the tree :meth:`update_params` takes)."""
        return self.params if self.lora is None else self.lora.detach(self.params)

    def recover_device_state(self) -> bool:
        """After a failed step: if the donated KV pools or sampling table were
        consumed, allocate fresh ones and return True (every sequence's KV is
        then lost); otherwise return False."""
        leaves = jax.tree_util.tree_leaves((self.kv_pools, self.sampling_table))
        if not any(leaf.is_deleted() for leaf in leaves):
            return False
        self.kv_pools = allocate_kv_cache(self.kv_spec, self.placement.pool_sharding)
        self.sampling_table = init_sampling_table(
            self.max_num_seqs, self.config.vocab_size, self.enable_penalties,
            self.placement.replicated,
        )
        self.seats.reset()
        return True

    # ------------------------------------------------------------------ steps
    def execute(
        self, plan: StepPlanLike, prompt_targets: np.ndarray | None = None
    ) -> StepOutput:
        """Run one step plan; returns the tokens sampled at ``plan.logits_indices``.

        ``plan.sample_rows`` are seats bound with :meth:`set_request`.
        """
        return self.dispatch(plan, prompt_targets).result()

    def dispatch(
        self,
        plan: StepPlanLike,
        prompt_targets: np.ndarray | None = None,
        token_bitmask_fn: Callable[[], np.ndarray | None] | None = None,
    ) -> PendingStep:
        """Enqueue one step on the device and return at once (JAX dispatch is
        asynchronous); ``result()`` waits for the sampled tokens. The host can
        do other work, such as detokenizing the previous step, in between.

        ``prompt_targets`` (int32 ``[num_tokens]``, -1 = none; see
        :func:`kvpage.runner.prompt_scoring.prompt_targets`) asks for the
        log-probability of each target token under the distribution at that step
        token, from this same forward pass (the bucket's prompt-scoring select, compiled
        on first use); the result then carries ``prompt_logprobs`` and friends.

        Grammar masks come either with the plan (``plan.token_bitmask``) or from
        ``token_bitmask_fn``, which is called on the host once embed, the layer groups
        and select are enqueued, so it runs while the device computes them; head
        (sampling) is enqueued with its result."""
        return self.steps.dispatch(plan, prompt_targets, token_bitmask_fn)

    def check(self, plan: StepPlanLike, num_sampled: int) -> None:
        """Range-check ``plan`` (:func:`check_plan`) unless ``validate_plans`` is off."""
        if self.validate_plans:
            check_plan(plan, num_sampled, self.kv_spec, self.max_num_seqs, self.max_model_len,
                       self.max_sampled_rows)

    def raise_if_params_deleted(self, exc: Exception) -> None:
        """A step failed: say so plainly when it was because the params were donated."""
        if any(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(self.params)):
            raise RuntimeError(
                "the runner's params were deleted (donated to a training step?): pass "
                "the new params to update_params before generating again"
            ) from exc
