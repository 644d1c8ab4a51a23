"""What the runner's collaborators read of the runner they serve.

:class:`RunnerState` is the contract between :class:`~kvpage.runner.model_runner.ModelRunner`
(the facade that owns the state) and its collaborators
(:mod:`~kvpage.runner.step_executables`, :mod:`~kvpage.runner.step_dispatch`,
:mod:`~kvpage.runner.seats`, :mod:`~kvpage.runner.multi_step_decode`): they hold the
runner weakly and read, or for the donated buffers replace, exactly these members. Typed
structurally, so the collaborators never import the facade (dependencies point one way).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import jax
    from jax.sharding import Mesh

    from kvpage.model.attention import AttentionBackend
    from kvpage.model.config import ModelConfig
    from kvpage.model.params import Params
    from kvpage.runner.kv_cache import KVCacheSpec, KVPools
    from kvpage.runner.layered_step import LayerPlan
    from kvpage.runner.placement import Placement
    from kvpage.runner.step_inputs import PaddingValues
    from kvpage.runner.step_plan import StepPlanLike
    from kvpage.sampling.table import SamplingTable


class RunnerState(Protocol):
    """The runner's state and limits, as its collaborators see them."""

    # the model and where it lives
    config: ModelConfig
    params: Params
    backend: AttentionBackend
    placement: Placement
    mesh: Mesh | None
    device: jax.Device
    layer_plan: LayerPlan
    stacked: bool
    # device state the steps donate and replace
    kv_pools: KVPools
    sampling_table: SamplingTable
    step_counter: int
    last_enqueue_time: float
    # limits and buckets
    kv_spec: KVCacheSpec
    padding: PaddingValues
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_logprobs: int
    max_fused_copies: int
    max_blocks_per_seq: int
    max_token_seq_ratio: int
    enable_penalties: bool
    seed: int
    token_buckets: tuple[int, ...]
    seq_buckets: tuple[int, ...]
    num_scheduler_steps: int
    multi_step_max_rows: int
    # collaborators that read each other
    seats: Any
    steps: Any

    def check(self, plan: StepPlanLike, num_sampled: int) -> None: ...

    def raise_if_params_deleted(self, exc: Exception) -> None: ...
