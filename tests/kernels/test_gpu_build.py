"""The GPU path builds for an H100, checked on a CPU machine (issue [gpubuild]).

* ``jax.export`` with ``platforms=["cuda"]`` of both Pallas kernels (compiled,
  not interpreted) and of a whole model step with the Pallas backend forced on,
  at Llama-3-8B attention shapes and at a GQA-odd real shape, for decode-only,
  mixed and prefill buckets. Export refuses to serialize Triton custom calls
  unless told to, so the custom-call safety check is disabled: lowering is
  what is checked here.
* The Triton IR of the bf16 kernels compiles for sm_90a through ptxas with no
  register spills (``kvpage.kernels.pallas.triton_build``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

pytest.importorskip("jaxlib.triton")

from jax import export  # noqa: E402
from kvpage.kernels.dispatch import compiled_kernels  # noqa: E402
from kvpage.kernels.pallas import triton_build  # noqa: E402
from kvpage.kernels.pallas.paged_decode_attention import paged_decode_attention  # noqa: E402
from kvpage.kernels.pallas.ragged_paged_attention import ragged_paged_attention  # noqa: E402

TRITON_CALL = "__gpu$xla.gpu.triton"
# bucket -> (rows, tokens, decode_only)
BUCKETS = {"decode": (16, 16, True), "mixed": (8, 64, False), "prefill": (2, 256, False)}


def _export_cuda(fn, *args) -> export.Exported:
    return export.export(
        jax.jit(fn),
        platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON_CALL)],
    )(*args)


def _triton_calls(exp: export.Exported) -> int:
    return exp.mlir_module().count(TRITON_CALL)


@pytest.mark.parametrize("bucket", list(BUCKETS))
@pytest.mark.parametrize("shape", list(triton_build.SHAPES))
def test_kernels_export_for_cuda(shape: str, bucket: str) -> None:
    rows, tokens, decode_only = BUCKETS[bucket]
    d = triton_build.SHAPES[shape][2]
    args = triton_build.kernel_args(shape, jnp.bfloat16, rows=rows, tokens=tokens)
    kernels = [ragged_paged_attention] + ([paged_decode_attention] if decode_only else [])
    for kernel in kernels:
        exp = _export_cuda(functools.partial(kernel, sm_scale=d**-0.5, interpret=False), *args)
        assert exp.platforms == ("cuda",)
        assert _triton_calls(exp) >= 1, kernel.__name__


# Sliding window, soft-cap and sinks: the options of reference.py, at Llama-3-8B shapes.
OPTION_CASES = {
    "window": dict(sliding_window=100),
    "gemma2": dict(sliding_window=100, logit_soft_cap=50.0),
    "gpt-oss": dict(sliding_window=128, sinks=True),
}


def _with_options(kernel: str, case: str):
    """(function, abstract args) of one Pallas kernel with one option case."""
    hq, _, d = triton_build.SHAPES["llama3-8b"]
    options = dict(OPTION_CASES[case])
    with_sinks = options.pop("sinks", False)
    fn, rows, tokens = {
        "ragged": (ragged_paged_attention, 8, 64),
        "decode": (paged_decode_attention, 16, 16),
    }[kernel]
    args = triton_build.kernel_args("llama3-8b", jnp.bfloat16, rows=rows, tokens=tokens)

    def call(*a):
        sinks = a[7] if with_sinks else None
        return fn(*a[:7], sm_scale=d**-0.5, interpret=False, sinks=sinks, **options)

    sinks = (jax.ShapeDtypeStruct((hq,), jnp.float32),) if with_sinks else ()
    return call, (*args, *sinks)


@pytest.mark.parametrize("case", list(OPTION_CASES))
@pytest.mark.parametrize("kernel", ["ragged", "decode"])
def test_kernels_with_window_cap_and_sinks_export_for_cuda(kernel: str, case: str) -> None:
    fn, args = _with_options(kernel, case)
    exp = _export_cuda(fn, *args)
    assert _triton_calls(exp) >= 1


def test_kernels_with_every_option_compile_for_sm90a_without_spills() -> None:
    reason = triton_build.triton_available()
    if reason:
        pytest.skip(f"cannot compile for sm_90a: {reason}")
    for kernel in ("ragged", "decode"):
        fn, args = _with_options(kernel, "gpt-oss")
        modules = triton_build.lower_for_cuda(fn, *args)
        modules += triton_build.lower_for_cuda(_with_options(kernel, "gemma2")[0], *args[:7])
        assert len(modules) == 2
        for module in modules:
            build = triton_build.compile_sm90a(module)
            print(f"\n{kernel} {module.name}: {build}")
            assert build.spill_stores == 0 and build.spill_loads == 0, build
            assert build.mma != "none", build


def _model_step_args(shape: str, bucket: str):
    from kvpage.model.attention import get_attention_backend
    from kvpage.model.config import ModelConfig
    from kvpage.model.decoder import AttentionMetadata, forward
    from kvpage.model.params import param_spec, tree_from_flat

    hq, hkv, d = triton_build.SHAPES[shape]
    rows, tokens, decode_only = BUCKETS[bucket]
    # Real attention shapes; a shallow, narrow-vocab body (params are abstract anyway).
    config = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=1024, hidden_size=hq * d,
        intermediate_size=2 * hq * d, num_layers=2, num_heads=hq, num_kv_heads=hkv,
        head_dim=d, dtype="bfloat16",
    )  # fmt: skip
    sds = jax.ShapeDtypeStruct
    params = tree_from_flat(
        config, {n: sds(s, jnp.bfloat16) for n, s in param_spec(config).items()}
    )
    pool = sds((hkv, 257, triton_build.BLOCK_SIZE, d), jnp.bfloat16)
    i32 = jnp.int32
    meta = AttentionMetadata(
        slot_mapping=sds((tokens,), i32),
        block_tables=sds((rows, 64), i32),
        kv_lens=sds((rows,), i32),
        cu_q_lens=sds((rows + 1,), i32),
        num_seqs=sds((1,), i32),
    )
    backend = get_attention_backend("pallas")
    step = functools.partial(forward, config=config, backend=backend, decode_only=decode_only)

    def fn(params, token_ids, positions, pools, meta, logits_indices):
        return step(params, token_ids=token_ids, positions=positions, kv_pools=pools,
                    meta=meta, logits_indices=logits_indices)  # fmt: skip

    pools = [(pool, pool)] * config.num_layers
    args = (params, sds((tokens,), i32), sds((tokens,), i32), pools, meta, sds((rows,), i32))
    return fn, args, config


@pytest.mark.parametrize("bucket", list(BUCKETS))
@pytest.mark.parametrize("shape", list(triton_build.SHAPES))
def test_model_step_exports_for_cuda_with_pallas(shape: str, bucket: str) -> None:
    fn, args, config = _model_step_args(shape, bucket)
    with compiled_kernels():
        exp = _export_cuda(fn, *args)
    # The compiled Pallas kernels (not the interpreter, not the XLA backend) are in the step;
    # layers share one jitted kernel function, so one call site may serve all of them.
    assert _triton_calls(exp) >= 1
    kernel = "paged_decode_attention" if BUCKETS[bucket][2] else "ragged_paged_attention"
    assert kernel in exp.mlir_module()
    logits = exp.out_avals[0]
    assert logits.shape == (BUCKETS[bucket][0], config.vocab_size)


def test_compiled_kernels_only_inside_the_block() -> None:
    from kvpage.kernels.dispatch import interpret_default

    expected = jax.default_backend() not in ("gpu", "cuda", "rocm")
    assert interpret_default() is expected
    with compiled_kernels():
        assert interpret_default() is False
    assert interpret_default() is expected


def test_bf16_kernels_compile_for_sm90a_without_spills() -> None:
    reason = triton_build.triton_available()
    if reason:
        pytest.skip(f"cannot compile for sm_90a: {reason}")
    rows = triton_build.kernel_report(dtypes=("bfloat16",))
    print("\n" + triton_build.format_table(rows))
    assert {(r["kernel"], r["shape"]) for r in rows} == {
        (k, s) for k in ("decode", "ragged") for s in triton_build.SHAPES
    }
    for r in rows:
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r
        assert r["mma"] != "none", r  # bf16 dots run on tensor cores
        assert r["blocks_per_sm"] >= 1, r


def test_occupancy_model() -> None:
    # 128 regs x 4 warps = 16K regs/block -> 4 by registers; 72 KiB smem -> 3 by smem.
    assert triton_build.blocks_per_sm(128, 72 * 1024, 4) == 3
    assert triton_build.blocks_per_sm(255, 0, 4) == 2
    assert triton_build.blocks_per_sm(32, 0, 4) == 16


# ---- weight-only int8 matmul (issue #27) ----------------------------------------------

INT8_SHAPES = {"llama3-8b-up": (4096, 14336), "llama3-8b-down": (14336, 4096)}


@pytest.mark.parametrize("rows", [16, 256])
def test_int8_matmul_exports_for_cuda(rows: int) -> None:
    from kvpage.kernels.pallas.int8_matmul import int8_matmul_nt

    k, n = INT8_SHAPES["llama3-8b-up"]
    sds = jax.ShapeDtypeStruct
    args = (sds((rows, k), jnp.bfloat16), sds((n, k), jnp.int8), sds((n,), jnp.float32))
    exp = _export_cuda(functools.partial(int8_matmul_nt, interpret=False), *args)
    assert _triton_calls(exp) == 1
    assert exp.out_avals[0].shape == (rows, n)


def test_model_step_with_int8_weights_exports_for_cuda() -> None:
    """A whole step whose linear weights are per-channel int8 exports for CUDA with the
    Pallas int8 kernel in it (the runner traces steps with the kernel switch on)."""
    from kvpage.model.linear_kernels import host_matmuls
    from kvpage.quant import QuantizedWeight

    fn, args, config = _model_step_args("llama3-8b", "decode")
    params = args[0]

    def int8(leaf: jax.ShapeDtypeStruct) -> QuantizedWeight:
        sds = jax.ShapeDtypeStruct
        return QuantizedWeight(sds(leaf.shape, jnp.int8), "int8", leaf.shape, jnp.bfloat16,
                               row_scales=sds(leaf.shape[:1], jnp.float32))

    for layer in params["layers"]:
        for group in ("self_attn", "mlp"):
            for module in layer[group].values():
                module["weight"] = int8(module["weight"])
    with compiled_kernels(), host_matmuls(True):
        exp = _export_cuda(fn, *args)
    text = exp.mlir_module()
    assert text.count("int8_matmul") >= 1
    assert "kvpage_qmatmul" not in text  # the CPU kernel is not in a CUDA program


def test_int8_matmul_compiles_for_sm90a_without_spills() -> None:
    from kvpage.kernels.pallas.int8_matmul import int8_matmul_nt

    reason = triton_build.triton_available()
    if reason:
        pytest.skip(f"cannot compile for sm_90a: {reason}")
    k, n = INT8_SHAPES["llama3-8b-down"]
    sds = jax.ShapeDtypeStruct
    for rows in (16, 128):
        args = (sds((rows, k), jnp.bfloat16), sds((n, k), jnp.int8), sds((n,), jnp.float32))
        modules = triton_build.lower_for_cuda(
            functools.partial(int8_matmul_nt, interpret=False), *args
        )
        assert len(modules) == 1
        build = triton_build.compile_sm90a(modules[0])
        print(f"\nint8_matmul rows {rows}: {build}")
        assert build.spill_stores == 0 and build.spill_loads == 0, build
        assert build.mma != "none", build  # the bf16 dot runs on tensor cores


# ---- grouped matmul: mixture-of-experts layers ------------------------------------------

# name -> (experts, K, N) of the expert up projection (HF [out, in] weight [E, N, K]).
GROUPED_SHAPES = {"mixtral-8x7b-up": (8, 4096, 14336), "qwen3-30b-a3b-up": (128, 2048, 768)}
GROUPED_ROWS = (64, 2048)  # 8 decode tokens x top-8; a 256-token prefill x top-8


def _grouped_args(shape: str, rows: int, weight_dtype=jnp.bfloat16):
    e, k, n = GROUPED_SHAPES[shape]
    sds = jax.ShapeDtypeStruct
    return (sds((rows, k), jnp.bfloat16), sds((e, n, k), weight_dtype), sds((e,), jnp.int32))


@pytest.mark.parametrize("rows", GROUPED_ROWS)
@pytest.mark.parametrize("shape", list(GROUPED_SHAPES))
def test_grouped_matmul_exports_for_cuda(shape: str, rows: int) -> None:
    from kvpage.kernels.pallas.grouped_matmul import grouped_matmul

    args = _grouped_args(shape, rows)
    with compiled_kernels():  # interpret=None follows the kernel switch, like attention
        exp = _export_cuda(grouped_matmul, *args)
    assert _triton_calls(exp) == 1
    assert exp.out_avals[0].shape == (rows, args[1].shape[1])
    assert exp.out_avals[0].dtype == jnp.bfloat16


def test_grouped_int8_matmul_exports_for_cuda() -> None:
    from kvpage.kernels.pallas.grouped_matmul import grouped_int8_matmul

    x, q, g = _grouped_args("qwen3-30b-a3b-up", 64, jnp.int8)
    scale = jax.ShapeDtypeStruct(q.shape[:2], jnp.float32)
    exp = _export_cuda(functools.partial(grouped_int8_matmul, interpret=False), x, q, scale, g)
    assert _triton_calls(exp) == 1
    assert exp.out_avals[0].shape == (64, q.shape[1])


def test_grouped_matmul_compiles_for_sm90a_without_spills() -> None:
    from kvpage.kernels.pallas.grouped_matmul import grouped_int8_matmul, grouped_matmul

    reason = triton_build.triton_available()
    if reason:
        pytest.skip(f"cannot compile for sm_90a: {reason}")
    builds = []
    for shape in GROUPED_SHAPES:
        for rows in GROUPED_ROWS:
            fn = functools.partial(grouped_matmul, interpret=False)
            builds += triton_build.lower_for_cuda(fn, *_grouped_args(shape, rows))
    x, q, g = _grouped_args("qwen3-30b-a3b-up", 64, jnp.int8)
    scale = jax.ShapeDtypeStruct(q.shape[:2], jnp.float32)
    fn = functools.partial(grouped_int8_matmul, interpret=False)
    builds += triton_build.lower_for_cuda(fn, x, q, scale, g)
    assert len(builds) == 2 * len(GROUPED_SHAPES) + 1
    for module in builds:
        build = triton_build.compile_sm90a(module)
        print(f"\n{module.name} grid {module.grid}: {build}")
        assert build.spill_stores == 0 and build.spill_loads == 0, build
        assert build.mma != "none", build  # bf16 dots run on tensor cores
        assert build.blocks_per_sm >= 1, build


def test_speculative_verification_exports_for_cuda() -> None:
    """A verification step's sampling lowers for CUDA: each sampled row's draft and offset
    (:mod:`kvpage.sampling.verification`), sampling at the offset token index, the keep
    rule and recording the kept rows (the model pass is the mixed bucket above)."""
    from kvpage.sampling.sampler import sample
    from kvpage.sampling.table import gather_inputs, init_sampling_table, record_sampled
    from kvpage.sampling.verification import draft_rows, kept_rows

    rows, tokens, vocab = 8, 64, 512

    def verify(logits, token_ids, logits_indices, seats, num_sampled, table):
        offsets, drafts = draft_rows(token_ids, logits_indices, seats, num_sampled)
        inputs = gather_inputs(table, seats)
        inputs = inputs._replace(step=inputs.step + offsets)
        out = sample(logits, inputs, jax.random.key(0), 2)
        kept = kept_rows(offsets, drafts, out.token_ids) & (jnp.arange(rows) < num_sampled)
        return out.token_ids, record_sampled(table, seats, out.token_ids, kept)

    table = init_sampling_table(4, vocab, enable_penalties=True)
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    exp = _export_cuda(
        verify, jax.ShapeDtypeStruct((rows, vocab), jnp.float32), i32((tokens,)), i32((rows,)),
        i32((rows,)), i32(()), jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                                            table),
    )
    assert exp.platforms == ("cuda",)
