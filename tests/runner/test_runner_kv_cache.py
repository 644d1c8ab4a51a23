"""KV cache sizing and allocation, plus plan packing/padding conventions."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import model_fixtures  # noqa: F401  (sys.path / import setup, before kvpage)
import numpy as np
import pytest
from kvpage.model import preset
from kvpage.model.params import param_spec, tree_from_flat
from kvpage.runner import (
    KVCacheSpec,
    ModelRunner,
    StepPlan,
    allocate_kv_cache,
    decide_num_blocks,
    kv_cache_sizing,
)
from kvpage.runner.buckets import default_buckets, pick_bucket, power_of_two_buckets
from kvpage.runner.kv_cache import copy_blocks
from kvpage.runner.step_inputs import PackedLayout, PaddingValues

LLAMA_8B = preset("llama-3-8b")


def test_spec_shapes_and_bytes() -> None:
    spec = KVCacheSpec.for_model(LLAMA_8B, block_size=16, num_blocks=1000)
    assert spec.pool_shape == (8, 1001, 16, 128)
    assert spec.scratch_block == 1000 and spec.scratch_slot == 16000
    # 2 (K, V) x 32 layers x 8 heads x 16 tokens x 128 dims x 2 bytes
    assert spec.bytes_per_block == 2 * 32 * 8 * 16 * 128 * 2
    assert spec.total_bytes == spec.bytes_per_block * 1001


class FakeDevice:
    platform = "gpu"

    def __init__(self, stats: dict[str, int] | None) -> None:
        self.stats = stats

    def memory_stats(self) -> dict[str, int] | None:
        return self.stats


GIB = 1 << 30
PER_BLOCK = KVCacheSpec.for_model(LLAMA_8B, 16, 1).bytes_per_block


def _decide(**kwargs: Any) -> Any:
    args: dict[str, Any] = dict(
        bytes_per_block=PER_BLOCK,
        block_size=16,
        max_model_len=8192,
        max_num_seqs=256,
        max_num_batched_tokens=2048,
        itemsize=2,
    )
    return decide_num_blocks(LLAMA_8B, **(args | kwargs))


def test_gpu_pool_from_memory_utilization_after_params_and_activations() -> None:
    device: Any = FakeDevice({"bytes_limit": 80 * GIB, "bytes_in_use": 16 * GIB})
    decision = _decide(memory_utilization=0.9, device=device)
    activations = kv_cache_sizing.step_activation_bytes(LLAMA_8B, 2048, 256, 2)
    assert 0 < activations < 8 * GIB
    expected = (int(80 * GIB * 0.9) - 16 * GIB - activations) // PER_BLOCK - 1
    assert decision.num_blocks == expected
    assert "device memory" in decision.reason
    with pytest.raises(ValueError, match="cannot hold one max_model_len=8192"):
        _decide(memory_utilization=0.25, device=device)


def test_cpu_pool_is_a_stable_share_of_total_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu: Any = type("Cpu", (), {"platform": "cpu"})()
    monkeypatch.setattr(kv_cache_sizing, "host_total_bytes", lambda: 24 * GIB)
    sizes = set()
    for available in (21.3, 22.0, 17.9):  # what another process left free at each start
        monkeypatch.setattr(kv_cache_sizing, "host_available_bytes", lambda a=available: a * GIB)
        sizes.add(_decide(device=cpu).num_blocks)
    assert len(sizes) == 1  # the executables' shapes, and the compilation cache key, hold
    decision = _decide(device=cpu)
    assert decision.total_bytes <= kv_cache_sizing.CPU_KV_MEMORY_CAP
    assert "host memory" in decision.reason
    small = _decide(device=cpu, max_num_seqs=2, max_model_len=1024)
    assert small.num_blocks == 2 * 1024 // 16  # what the configuration can use, no more
    # A busy machine: the budget halves until it fits half of what is available.
    monkeypatch.setattr(kv_cache_sizing, "host_available_bytes", lambda: 5 * GIB)
    busy = _decide(device=cpu)
    assert busy.total_bytes <= 2.5 * GIB and "halved" in busy.reason
    monkeypatch.setattr(kv_cache_sizing, "host_available_bytes", lambda: 1 * GIB)
    with pytest.raises(ValueError, match="lower max_model_len"):
        _decide(device=cpu)


def test_explicit_sizes_win_and_are_checked() -> None:
    assert _decide(num_blocks=600).num_blocks == 600
    tenth = _decide(kv_cache_memory=10 * PER_BLOCK, max_model_len=64)
    assert tenth.num_blocks == 9  # minus the scratch block
    fits = _decide(kv_cache_memory=(8192 // 16 + 1) * PER_BLOCK)
    assert fits.capacity_tokens == 8192
    with pytest.raises(ValueError, match="needs 512 blocks"):
        _decide(kv_cache_memory=100 * PER_BLOCK)


def test_allocate_and_copy_blocks() -> None:
    config = preset("tiny-llama")
    spec = KVCacheSpec.for_model(config, block_size=4, num_blocks=6, dtype="float32")
    pools = allocate_kv_cache(spec)
    assert len(pools) == config.num_layers
    assert pools[0][0].shape == (2, 7, 4, 16) and pools[0][0].dtype == jnp.float32
    filled = [
        (k + jnp.arange(7, dtype=jnp.float32)[None, :, None, None], v - 1.0) for k, v in pools
    ]
    # The second copy entry is padding: destination out of range, dropped.
    copied = jax.jit(copy_blocks)(filled, jnp.asarray([1, 6]), jnp.asarray([4, 7]))
    k = np.asarray(copied[1][0])
    assert (k[:, 4] == 1.0).all() and (k[:, 1] == 1.0).all() and (k[:, 6] == 6.0).all()
    np.testing.assert_array_equal(np.asarray(copied[0][1]), -1.0)


def _resident_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**20


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_a_cpu_pool_holds_no_memory_until_written_and_reads_zero(dtype: str) -> None:
    """``kvpage_zeros`` pools: 1 GiB is ready without being written (resident memory
    grows by far less than the pool), reads zero (also after pools full of ones were
    freed: recycled memory is zeroed too, rust/kernels/lazy_zeros.rs tests it byte by
    byte), and is updated in place by a donating step."""
    from kvpage.runner.kv_cache import _lazy_zeros

    if _lazy_zeros((1,), jnp.float32, None) is None:
        pytest.skip("no kvpage_zeros here (not a CPU device)")
    config = preset("tiny-llama")
    spec = KVCacheSpec.for_model(config, block_size=16, num_blocks=2**30 // (
        KVCacheSpec.for_model(config, block_size=16, num_blocks=1, dtype=dtype).bytes_per_block
    ), dtype=dtype)
    for _ in range(2):
        before = _resident_mib()
        pools = allocate_kv_cache(spec)
        assert _resident_mib() - before < 64, "the pool was written at allocation"
        k = pools[-1][0]
        assert not np.asarray(k[:, -4:]).any() and not np.asarray(k[:, :4]).any()
        pointer = k.unsafe_buffer_pointer()
        k = jax.jit(lambda pool: pool.at[:, 1].set(1.0), donate_argnums=0)(k)
        assert k.unsafe_buffer_pointer() == pointer
        assert np.asarray(k[:, 1]).all() and not np.asarray(k[:, 2]).any()
        pools = [(jnp.ones_like(a), jnp.ones_like(b)) for a, b in pools]  # write all
        del pools, k


def test_buckets() -> None:
    assert power_of_two_buckets(16, 100) == (16, 32, 64, 128)
    assert pick_bucket((16, 32), 17, "tokens") == 32
    with pytest.raises(ValueError, match="tokens 33"):
        pick_bucket((16, 32), 33, "tokens")


def test_cpu_token_buckets_add_half_steps_for_long_prompts() -> None:
    assert default_buckets("cpu", 2048, "tokens") == (
        1, 4, 8, 16, 32, 64, 128, 256, 512, 768, 1024, 1536, 2048,
    )  # fmt: skip
    assert default_buckets("cpu", 1000, "tokens")[-3:] == (512, 768, 1024)
    assert default_buckets("cpu", 256, "seqs") == (1, 4, 8, 16, 32, 64, 128, 256)
    assert default_buckets("gpu", 2048, "tokens") == power_of_two_buckets(16, 2048)


def test_packing_pads_with_harmless_values() -> None:
    layout = PackedLayout(num_tokens=8, num_seqs=4, num_copies=2, max_blocks=3)
    pad = PaddingValues(scratch_slot=40, scratch_block=10, dummy_sample_row=5, dropped_block=11)
    plan = StepPlan(
        token_ids=np.asarray([7, 8, 9], np.int32),
        positions=np.asarray([4, 0, 1], np.int32),
        slot_mapping=np.asarray([12, 20, 21], np.int32),
        cu_q_lens=np.asarray([0, 1, 3], np.int32),
        kv_lens=np.asarray([5, 2], np.int32),
        block_tables=np.asarray([[2, 3], [5, 10]], np.int32),
        logits_indices=np.asarray([0, 2], np.int32),
        sample_rows=np.asarray([1, 3], np.int32),
        copy_src=np.asarray([2], np.int32),
        copy_dst=np.asarray([4], np.int32),
    )
    buf = layout.pack(plan, layout.template(pad), 4, 7, True, include_copies=True)
    a = jax.device_get(layout.unpack(jnp.asarray(buf)))
    np.testing.assert_array_equal(a.token_ids, [7, 8, 9, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(a.meta.slot_mapping, [12, 20, 21, 40, 40, 40, 40, 40])
    np.testing.assert_array_equal(a.meta.cu_q_lens, [0, 1, 3, 3, 3])
    np.testing.assert_array_equal(a.meta.kv_lens, [5, 2, 0, 0])
    np.testing.assert_array_equal(
        a.meta.block_tables, [[2, 3, 10], [5, 10, 10], [10, 10, 10], [10, 10, 10]]
    )
    np.testing.assert_array_equal(a.meta.num_seqs, [2])
    np.testing.assert_array_equal(a.logits_indices, [0, 2, 0, 0])
    np.testing.assert_array_equal(a.sample_rows, [1, 3, 5, 5])
    np.testing.assert_array_equal(a.copy_src, [2, 10])
    np.testing.assert_array_equal(a.copy_dst, [4, 11])
    assert int(a.num_sampled) == 2 and int(a.step_counter) == 7 and bool(a.want_top_logprobs)


def test_every_step_size_lands_in_a_warmup_bucket() -> None:
    config = preset("tiny-llama")
    params = tree_from_flat(
        config, {name: np.zeros(shape, np.float32) for name, shape in param_spec(config).items()}
    )
    runner = ModelRunner(
        config, params, num_blocks=16, block_size=4, max_model_len=64, max_num_seqs=64,
        max_num_batched_tokens=512,
    )
    keys = set(runner.executables.warmup_buckets())
    assert len(keys) == len(runner.executables.warmup_buckets())
    for num_tokens in range(1, 513):
        for num_seqs in {1, 2, 7, num_tokens // 3, num_tokens // 2, num_tokens}:
            if 1 <= num_seqs <= min(num_tokens, 64):
                t_pad, s_pad = runner.executables.padded_sizes(num_tokens, num_seqs)
                assert (t_pad, s_pad, False) in keys
                assert t_pad >= num_tokens and s_pad >= num_seqs
    # Large token buckets skip the smallest sequence buckets (max_token_seq_ratio=16).
    assert runner.executables.padded_sizes(300, 1) == (512, 32)


def test_step_scratch_does_not_follow_the_pool_or_max_model_len() -> None:
    """The compiled step's scratch is the same for a 64x larger pool and a 16x larger
    max_model_len (attention loops over live KV), and the donated pools are updated in
    place (aliased to the outputs), never allocated anew per step."""
    config = preset("tiny-llama")
    params = tree_from_flat(
        config, {name: np.zeros(shape, np.float32) for name, shape in param_spec(config).items()}
    )

    def scratch(num_blocks: int, max_model_len: int) -> int:
        runner = ModelRunner(
            config, params, num_blocks=num_blocks, block_size=4, max_model_len=max_model_len,
            max_num_seqs=8, max_num_batched_tokens=32,
        )
        # A layer piece runs once per group of layers on those layers' donated pools.
        (count, piece), = runner.executables.bucket((16, 8, False)).layers.items()
        memory = piece.memory_analysis()
        group_bytes = runner.kv_spec.total_bytes * count // config.num_layers
        assert memory.alias_size_in_bytes >= group_bytes
        return int(memory.temp_size_in_bytes)

    base = scratch(64, 64)
    assert scratch(64 * 64, 64) <= 1.1 * base + 65536
    assert scratch(64 * 16, 64 * 16) <= 1.1 * base + 65536
