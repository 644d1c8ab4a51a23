"""kvpage.runner: executes scheduler step plans on the device.

* :mod:`~kvpage.runner.protocol`       -- :class:`StepRunner`, the engine's view of a runner,
  and the id spaces (seat, block, slot).
* :mod:`~kvpage.runner.step_plan`      -- the plan contract (+ a Python :class:`StepPlan`).
* :mod:`~kvpage.runner.model_runner`   -- :class:`ModelRunner`, the facade: its state
  (params, KV pools, sampling table) and the collaborators it delegates to:
  :mod:`~kvpage.runner.placement` (shardings), :mod:`~kvpage.runner.step_executables`
  (buckets, building, caching and warming every executable),
  :mod:`~kvpage.runner.seats` (sampling-table writes), :mod:`~kvpage.runner.plan_check`,
  :mod:`~kvpage.runner.step_dispatch` (one step), :mod:`~kvpage.runner.multi_step_decode`
  (several decode steps per call) and :mod:`~kvpage.runner.pending` (their results).
* :mod:`~kvpage.runner.kv_cache`       -- paged KV pool shape and allocation (split by KV head
  under tensor parallelism, see :mod:`kvpage.runner.tensor_parallel`).
* :mod:`~kvpage.runner.kv_cache_sizing` -- how many blocks the pool gets, and why.
* :mod:`~kvpage.runner.layered_step`   -- a step as embed, layer groups, select and head.
* :mod:`~kvpage.runner.multi_step`     -- the math of several decode steps in one call.
* :mod:`~kvpage.runner.prompt_scoring` -- prompt tokens scored in the prefill's forward pass.
* :mod:`~kvpage.runner.step_inputs`    -- packing a plan into one padded buffer.
* :mod:`~kvpage.runner.buckets`        -- padded sizes.
* :mod:`~kvpage.runner.executable_cache`, :mod:`~kvpage.runner.background_compiler`,
  :mod:`~kvpage.runner.executable_store` -- compile once across threads, in the
  background, and across starts.

Sampling, which every step ends with, is its own package: :mod:`kvpage.sampling`.
"""

from kvpage.runner.kv_cache import KVCacheSpec, allocate_kv_cache
from kvpage.runner.kv_cache_sizing import KVCacheDecision, decide_num_blocks
from kvpage.runner.model_runner import ModelRunner
from kvpage.runner.step_output import StepOutput
from kvpage.runner.step_plan import StepPlan, StepPlanLike

__all__ = [
    "KVCacheDecision",
    "KVCacheSpec",
    "ModelRunner",
    "StepOutput",
    "StepPlan",
    "StepPlanLike",
    "allocate_kv_cache",
    "decide_num_blocks",
]
