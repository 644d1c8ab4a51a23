"""The host small-batch matmul (Rust, called by XLA as an FFI custom call): equal to
XLA's dot, used only in its row range and only inside the runner's switch, absent from
GPU programs and from differentiated code, and bad shapes as errors."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import model_fixtures  # noqa: F401  (sys.path / import setup, before kvpage)
import numpy as np
import pytest
from kvpage.kernels.host import cpu_matmul
from kvpage.kernels.host._host_ffi import register
from kvpage.model import load_model
from kvpage.model.dense import causal_lm_loss
from kvpage.model.linear_kernels import host_matmuls, matmul_nt
from kvpage.runner import ModelRunner
from model_fixtures import build_hf_model, save_hf_model

pytestmark = pytest.mark.skipif(
    not register(cpu_matmul.TARGET), reason="kvpage._core without the host matmul"
)


@pytest.fixture(autouse=True)
def routed_on_any_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Route to the kernel even on a CPU without AVX-512 (its portable loop), so
    these tests run on every CI machine."""
    monkeypatch.setenv("KVPAGE_CPU_MATMUL", "1")


def _operands(rows: int, inner: int, outs: int, seed: int = 0) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, inner), dtype=np.float32)
    w = rng.standard_normal((outs, inner), dtype=np.float32) * 0.05
    return jnp.asarray(x), jnp.asarray(w)


def _jitted():
    """A fresh function each time: JAX caches traces per function, and the switch is read
    at trace time."""
    return jax.jit(lambda x, w: matmul_nt(x, w))


def _lowered_text(x: jax.Array, w: jax.Array, switch: bool = True) -> str:
    with host_matmuls(switch):
        return _jitted().lower(x, w).as_text()


@pytest.mark.parametrize(
    "rows,inner,outs",
    [(1, 576, 1536), (2, 576, 1536), (3, 17, 5), (8, 64, 130), (13, 1536, 576), (16, 100, 63),
     (32, 48, 200)],
)
def test_equals_xla_dot_in_its_row_range(rows: int, inner: int, outs: int) -> None:
    x, w = _operands(rows, inner, outs, seed=rows)
    assert "kvpage_matmul_nt" in _lowered_text(x, w)
    with host_matmuls():
        got = _jitted()(x, w)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)
    assert np.asarray(got).dtype == np.float32


@pytest.mark.parametrize(
    "rows,dtype", [(33, jnp.float32), (512, jnp.float32), (4, jnp.bfloat16)]
)
def test_outside_its_range_xla_computes(rows: int, dtype: jnp.dtype) -> None:
    x, w = _operands(rows, 64, 96)
    x, w = x.astype(dtype), w.astype(dtype)
    assert "kvpage_matmul_nt" not in _lowered_text(x, w)


def test_off_by_default_and_never_in_gpu_programs() -> None:
    x, w = _operands(4, 64, 96)
    assert "kvpage_matmul_nt" not in _lowered_text(x, w, switch=False)
    assert "kvpage_matmul_nt" not in _jitted().lower(x, w).as_text()
    with host_matmuls():
        traced = _jitted().trace(x, w)
    assert "kvpage_matmul_nt" not in traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "kvpage_matmul_nt" in traced.lower().as_text()


def test_a_row_does_not_depend_on_the_other_rows() -> None:
    """Padding rows of a decode bucket must not change the live rows' results, and a row
    alone (a decode step) gets the bits it gets among others (a speculative verification)."""
    x, w = _operands(8, 576, 300)
    with host_matmuls():
        full = np.asarray(_jitted()(x, w))
        pair = np.asarray(_jitted()(x[:2], w))
        alone = np.asarray(_jitted()(x[1:2], w))
    np.testing.assert_array_equal(full[:2], pair)
    np.testing.assert_array_equal(full[1], alone[0])


def test_off_when_disabled_or_without_a_vectorized_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    x, w = _operands(4, 64, 96)
    monkeypatch.setenv("KVPAGE_CPU_MATMUL", "0")
    assert "kvpage_matmul_nt" not in _lowered_text(x, w)
    monkeypatch.setenv("KVPAGE_CPU_MATMUL", "auto")
    assert cpu_matmul.available() == (cpu_matmul._lanes() in cpu_matmul.MAX_ROWS_BY_LANES)


def test_bad_shapes_are_errors_naming_them() -> None:
    x, w = _operands(4, 64, 96)
    wrong = jax.ffi.ffi_call(cpu_matmul.TARGET, jax.ShapeDtypeStruct((4, 95), jnp.float32))
    with pytest.raises(Exception, match="inconsistent shapes"):
        jax.block_until_ready(jax.jit(wrong)(x, w))


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory):
    model = build_hf_model("llama", seed=5)
    return load_model(save_hf_model(model, Path(tmp_path_factory.mktemp("matmul"))))


def test_the_runner_decode_step_uses_it_and_training_never_does(tiny_llama) -> None:
    config, params = tiny_llama
    runner = ModelRunner(
        config, params, num_blocks=16, block_size=4, max_model_len=32, max_num_seqs=4,
        token_buckets=(4,), seq_buckets=(4,),
    )
    key = next(k for k in runner.executables.warmup_buckets() if k[0] == 4)
    layers = runner.executables.bucket(key).layers
    assert all("kvpage_matmul_nt" in piece.as_text() for piece in layers.values())
    # The dense training path differentiates through the same linear layers.
    tokens = jnp.asarray([[1, 2, 3, 4], [5, 6, 7, 8]], jnp.int32)
    grads = jax.grad(causal_lm_loss)(params, config, tokens)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree_util.tree_leaves(grads))
