"""Tensor parallelism on 8 simulated CPU devices: identical greedy tokens for TP 1/2/4/8,
the KV cache split by KV head, Megatron-style param shardings, clear errors for sizes
that do not divide the heads, zero-copy weight updates of pre-sharded params, the
Pallas kernel per shard, and two processes (the multi-host path) sharing one model.

scripts/test.sh sets ``XLA_FLAGS=--xla_force_host_platform_device_count=8``; without
8 visible devices the module is skipped.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import model_fixtures  # noqa: F401  (sys.path / import setup, before kvpage)
import numpy as np
import pytest

if len(jax.devices()) < 8:
    pytest.skip(
        f"tensor-parallel tests need 8 devices, {len(jax.devices())} visible; run "
        "scripts/test.sh or set XLA_FLAGS=--xla_force_host_platform_device_count=8 "
        "before JAX starts",
        allow_module_level=True,
    )

from jax.sharding import PartitionSpec as P  # noqa: E402
from kvpage import LLM, SamplingParams  # noqa: E402
from kvpage.model import ModelConfig, random_params  # noqa: E402
from kvpage.model.tiny_model import tiny_llama_config  # noqa: E402
from kvpage.runner.tensor_parallel import make_mesh, shard_params  # noqa: E402

PROMPTS = [
    {"prompt_token_ids": [5, 17, 99, 3, 42, 7, 250, 11, 64]},
    {"prompt_token_ids": list(range(20, 61))},
    {"prompt_token_ids": [300, 301, 302]},
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
ENGINE_ARGS: dict[str, Any] = dict(
    max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128, block_size=8, num_gpu_blocks=64
)


def make_config(**overrides: Any) -> ModelConfig:
    raw = tiny_llama_config(
        512, num_attention_heads=8, num_key_value_heads=8, head_dim=8, max_position_embeddings=256
    )
    raw.update(overrides)
    return ModelConfig.from_hf_dict(raw)


@pytest.fixture(scope="module")
def config() -> ModelConfig:
    return make_config()


@pytest.fixture(scope="module")
def params(config: ModelConfig) -> Any:
    # Large weights spread the logits, so greedy ties are not decided by rounding.
    return random_params(config, seed=3, dtype="float32", scale=0.15)


@pytest.fixture(scope="module")
def runs(config: ModelConfig, params: Any) -> dict[int, tuple[LLM, list[Any]]]:
    results = {}
    for tp in (1, 2, 4, 8):
        llm = LLM.from_params(config, params, tensor_parallel_size=tp, **ENGINE_ARGS)
        results[tp] = (llm, llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    return results


def test_greedy_tokens_identical_for_tp_1_2_4_8(runs: dict[int, tuple[LLM, list[Any]]]) -> None:
    base = [o.outputs[0] for o in runs[1][1]]
    assert all(len(c.token_ids) == 8 for c in base)
    for tp in (2, 4, 8):
        got = [o.outputs[0] for o in runs[tp][1]]
        assert [c.token_ids for c in got] == [c.token_ids for c in base], f"tp={tp}"
        np.testing.assert_allclose(
            [c.cumulative_logprob for c in got], [c.cumulative_logprob for c in base], atol=1e-4
        )


def test_kv_cache_per_device_shrinks_by_tp(
    runs: dict[int, tuple[LLM, list[Any]]], config: ModelConfig
) -> None:
    full = runs[1][0].engine.runner.kv_cache_bytes_per_device
    assert full == runs[1][0].engine.runner.kv_spec.total_bytes
    for tp in (2, 4, 8):
        runner = runs[tp][0].engine.runner
        assert runner.kv_cache_bytes_per_device * tp == full
        assert runner.kv_spec.bytes_per_device * tp == full
        k_pages = runner.kv_pools[0][0]
        assert k_pages.shape[0] == config.num_kv_heads  # the global view is unchanged
        assert {s.data.shape[0] for s in k_pages.addressable_shards} == {config.num_kv_heads // tp}
        assert len(k_pages.sharding.device_set) == tp


def test_params_are_sharded_megatron_style(runs: dict[int, tuple[LLM, list[Any]]]) -> None:
    runner = runs[4][0].engine.runner
    layer = runner.params["layers"][0]
    specs = {
        "q": layer["self_attn"]["q_proj"]["weight"].sharding.spec,
        "o": layer["self_attn"]["o_proj"]["weight"].sharding.spec,
        "up": layer["mlp"]["up_proj"]["weight"].sharding.spec,
        "down": layer["mlp"]["down_proj"]["weight"].sharding.spec,
        "norm": layer["input_layernorm"]["weight"].sharding.spec,
        "lm_head": runner.params["lm_head"]["weight"].sharding.spec,
    }
    assert specs == {
        "q": P("tp", None),
        "o": P(None, "tp"),
        "up": P("tp", None),
        "down": P(None, "tp"),
        "norm": P(None),
        "lm_head": P("tp", None),
    }
    # The sampled tokens and the sampling table are replicated on every device.
    assert runner.sampling_table.floats.sharding.is_fully_replicated


def test_sizes_that_do_not_divide_the_heads_are_rejected(params: Any) -> None:
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 .*num_heads=8.*num_kv_heads=8"):
        LLM.from_params(make_config(), params, tensor_parallel_size=3, **ENGINE_ARGS)
    gqa = make_config(num_key_value_heads=2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 .*num_kv_heads=2"):
        LLM.from_params(gqa, random_params(gqa), tensor_parallel_size=4, **ENGINE_ARGS)
    with pytest.raises(ValueError, match="needs that many devices"):
        make_mesh(len(jax.devices()) + 1)


def test_pre_sharded_params_are_adopted_without_copy(
    runs: dict[int, tuple[LLM, list[Any]]], config: ModelConfig, params: Any
) -> None:
    llm = runs[2][0]
    runner = llm.engine.runner
    compilations = runner.executables.num_compilations
    doubled = shard_params(config, jax.tree_util.tree_map(lambda x: x * 1.25, params), runner.mesh)
    version = llm.update_params(doubled)
    assert runner.last_update_copies == 0
    new_leaves = jax.tree_util.tree_leaves(doubled)
    assert all(
        a is b for a, b in zip(jax.tree_util.tree_leaves(runner.params), new_leaves, strict=True)
    )
    changed = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].params_versions for o in changed] == [[(0, version)]] * len(PROMPTS)
    # Unsharded (single-device) params are resharded device to device: same tokens.
    llm.update_params(params)
    assert runner.last_update_copies > 0
    again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in runs[2][1]]
    assert runner.executables.num_compilations == compilations


def test_stacked_layer_layout_is_sharded_too(
    runs: dict[int, tuple[LLM, list[Any]]], config: ModelConfig, params: Any
) -> None:
    # Scan-based training code keeps layers stacked along a leading axis.
    layers = jax.tree_util.tree_map(lambda *xs: jax.numpy.stack(xs), *params["layers"])
    stacked = shard_params(config, dict(params, layers=layers), make_mesh(2))
    assert stacked["layers"]["mlp"]["down_proj"]["weight"].sharding.spec == P(None, None, "tp")
    llm = LLM.from_params(config, stacked, tensor_parallel_size=2, **ENGINE_ARGS)
    assert llm.engine.runner.last_update_copies == 0
    got = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in runs[1][1]]


def test_pallas_kernel_runs_per_shard(config: ModelConfig) -> None:
    # One layer, one bucket: the interpreted Pallas kernels are slow to compile on CPU.
    small = make_config(num_hidden_layers=1, head_dim=16)
    weights = random_params(small, seed=5, dtype="float32", scale=0.15)
    args = dict(ENGINE_ARGS, max_num_seqs=2, max_num_batched_tokens=16, block_size=16)
    prompts = [PROMPTS[0], {"prompt_token_ids": list(range(40, 60))}]
    sampling = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    ref = LLM.from_params(small, weights, attention_backend="reference", **args)
    tp = LLM.from_params(small, weights, attention_backend="pallas", tensor_parallel_size=2, **args)
    expected = [o.outputs[0].token_ids for o in ref.generate(prompts, sampling, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in tp.generate(prompts, sampling, use_tqdm=False)]
    assert got == expected
    assert tp.engine.runner.backend.name == "pallas"
    assert any(decode for *_, decode in tp.engine.runner.executables.compiled_buckets)


_WORKER = """
import json, sys
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
port, process_id = sys.argv[1], int(sys.argv[2])
jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process_id)
from kvpage import LLM, SamplingParams
from kvpage.model import ModelConfig, random_params
from kvpage.model.tiny_model import tiny_llama_config
raw = tiny_llama_config(
    512, num_attention_heads=8, num_key_value_heads=8, head_dim=8, max_position_embeddings=256
)
config = ModelConfig.from_hf_dict(raw)
params = random_params(config, seed=3, dtype="float32", scale=0.15)
args, prompts, sampling = json.loads(sys.argv[3])
llm = LLM.from_params(config, params, tensor_parallel_size=4, **args)
outs = llm.generate(prompts, SamplingParams(**sampling), use_tqdm=False)
print("TOKENS", json.dumps([o.outputs[0].token_ids for o in outs]), flush=True)
jax.distributed.shutdown()
"""


def test_two_processes_share_one_tensor_parallel_model(
    runs: dict[int, tuple[LLM, list[Any]]], tmp_path: Path
) -> None:
    """Multi-host in miniature: 2 processes x 2 CPU devices run TP=4 over gloo."""
    if not hasattr(jax.config, "jax_cpu_collectives_implementation"):
        pytest.skip("this jax has no CPU cross-process collectives")
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        port = sock.getsockname()[1]
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    sampling = dict(temperature=0.0, max_tokens=8, ignore_eos=True)
    payload = json.dumps([ENGINE_ARGS, PROMPTS, sampling])
    root = Path(__file__).resolve().parents[2]
    env = dict(
        os.environ,
        XLA_FLAGS="--xla_force_host_platform_device_count=2",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join([str(root / "python"), str(root)]),
    )
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(port), str(i), payload],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    logs = [p.communicate(timeout=180)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    expected = [o.outputs[0].token_ids for o in runs[4][1]]
    for log in logs:
        line = next(x for x in log.splitlines() if x.startswith("TOKENS "))
        assert json.loads(line.removeprefix("TOKENS ")) == expected


def test_moe_sliding_window_soft_capped_model_is_the_same_sharded(config: ModelConfig) -> None:
    """Experts split within each expert, sliding layers with a window shorter than the
    prompts, soft-capped scores: tensor parallel 2 generates what one device does."""
    from kvpage.model.config import MoEConfig

    layer_types = tuple("sliding_attention" if i % 2 == 0 else "full_attention"
                        for i in range(config.num_layers))
    moe_config = config.with_overrides(
        architecture="Qwen3MoeForCausalLM", moe=MoEConfig(8, 2, 32), layer_types=layer_types,
        sliding_window=6, attn_logit_softcap=30.0,
    )
    params = random_params(moe_config, seed=4, dtype="float32", scale=0.15)
    outs = {}
    for tp in (1, 2):
        llm = LLM.from_params(moe_config, params, tensor_parallel_size=tp, **ENGINE_ARGS)
        outs[tp] = [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        if tp == 2:
            gate = llm.engine.runner.params["layers"][0]["mlp"]["experts"]["gate_proj"]["weight"]
            assert gate.sharding.spec == P(None, "tp", None)
    for a, b in zip(outs[1], outs[2], strict=True):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(
            [next(iter(lp.values())).logprob for lp in a.logprobs],
            [next(iter(lp.values())).logprob for lp in b.logprobs], atol=1e-4,
        )
