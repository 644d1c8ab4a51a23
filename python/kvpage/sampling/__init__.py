"""kvpage.sampling: how a token is chosen, from the user's parameters to the device math.

A new sampling parameter touches these files, top to bottom:

* :mod:`~kvpage.sampling.params`        -- the public :class:`SamplingParams` (vLLM's
  names), validated; splits into the scheduler's stop conditions and the device knobs.
* :mod:`~kvpage.sampling.device_params` -- :class:`DeviceSamplingParams`: the knobs the
  device sampler reads.
* :mod:`~kvpage.sampling.table`         -- those knobs as one device-resident row per
  seat, so changing them never recompiles.
* :mod:`~kvpage.sampling.sampler`       -- the batched sampling math of a whole step.
* :mod:`~kvpage.sampling.token_bitmask` -- structured outputs' token masks applied on
  device.

Stop conditions the scheduler checks (stop tokens, ``max_tokens``, ``min_tokens``) live in
the Rust core: ``RequestParams`` in ``rust/sched/request.rs``, checked by the scheduler's
``update`` (``rust/sched/scheduler/mod.rs``).
"""

from kvpage.sampling.device_params import DeviceSamplingParams
from kvpage.sampling.params import SamplingParams

__all__ = ["DeviceSamplingParams", "SamplingParams"]
