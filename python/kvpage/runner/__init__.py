"""kvpage.runner: executes scheduler step plans on the device.

* :mod:`~kvpage.runner.step_plan`      -- the plan contract (+ a Python :class:`StepPlan`).
* :mod:`~kvpage.runner.model_runner`   -- :class:`ModelRunner`: pad, run, sample.
* :mod:`~kvpage.runner.kv_cache`       -- paged KV pool shape and allocation (split by KV head
  under tensor parallelism, see :mod:`kvpage.runner.tensor_parallel`).
* :mod:`~kvpage.runner.kv_cache_sizing` -- how many blocks the pool gets, and why.
* :mod:`~kvpage.runner.layered_step`   -- a step as embed, layer groups, select and head.
* :mod:`~kvpage.runner.step_inputs`    -- packing a plan into one padded buffer.
* :mod:`~kvpage.runner.buckets`        -- padded sizes.

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
