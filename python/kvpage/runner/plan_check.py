"""Checking a step plan against the runner's limits before it reaches the device.

The plan's format is documented once, in ``rust/sched/step_plan.rs``; this file owns the
host-side range checks (``validate_plans``) the runner applies to every plan.
"""

from __future__ import annotations

import numpy as np

from kvpage.runner.kv_cache import KVCacheSpec
from kvpage.runner.step_plan import StepPlanLike


def check_plan(
    plan: StepPlanLike, num_sampled: int, kv_spec: KVCacheSpec, max_num_seqs: int,
    max_model_len: int, max_sampled_rows: int | None = None,
) -> None:
    """Range-check a plan against the runner's limits on the host (cheap numpy checks), so
    a bad plan is a ValueError naming the problem, never an out-of-range device access.
    ``max_sampled_rows`` (default ``max_num_seqs``): the most sampled rows of a step."""
    t, s = int(plan.num_tokens), int(plan.num_seqs)
    if len(plan.token_ids) < t or len(plan.positions) < t or len(plan.slot_mapping) < t:
        raise ValueError("plan token arrays are shorter than num_tokens")
    if len(plan.cu_q_lens) < s + 1 or len(plan.kv_lens) < s:
        raise ValueError("plan sequence arrays are shorter than num_seqs")
    if int(plan.cu_q_lens[s]) != t or int(plan.cu_q_lens[0]) != 0:
        raise ValueError("cu_q_lens must start at 0 and end at num_tokens")
    most = max(max_num_seqs, max_sampled_rows or 0)
    if num_sampled > most:
        raise ValueError(f"{num_sampled} sampled rows exceed {most} (max_num_seqs="
                         f"{max_num_seqs}, with drafts {max_sampled_rows})")
    if len(plan.sample_rows) != num_sampled:
        raise ValueError("sample_rows and logits_indices differ in length")
    if len(plan.copy_src) != len(plan.copy_dst):
        raise ValueError("copy_src and copy_dst differ in length")
    if plan.decode_only and not (t == s and np.all(np.diff(plan.cu_q_lens[: s + 1]) == 1)):
        raise ValueError("decode_only plan has a row with other than one query token")
    limit_slot = kv_spec.scratch_slot
    if t and (plan.slot_mapping[:t].min() < 0 or plan.slot_mapping[:t].max() > limit_slot):
        raise ValueError("slot_mapping out of range")
    if num_sampled:
        li, rows = plan.logits_indices, plan.sample_rows
        if li.min() < 0 or li.max() >= t:
            raise ValueError("logits_indices out of range")
        if rows.min() < 0 or rows.max() >= max_num_seqs:
            raise ValueError("sample_rows out of range")
    if s:
        tables = np.asarray(plan.block_tables)[:s]
        if tables.min() < 0 or tables.max() > kv_spec.scratch_block:
            raise ValueError("block_tables out of range")
        if int(np.max(plan.kv_lens[:s])) > max_model_len:
            raise ValueError("a kv_len exceeds max_model_len")
    for ids in (plan.copy_src, plan.copy_dst):
        if len(ids) and (ids.min() < 0 or ids.max() >= kv_spec.num_blocks):
            raise ValueError("copy block ids out of range")
