"""Sliding-window attention, logit soft-capping and attention sinks in every backend.

Each backend (the jnp reference, the ``xla`` backend with its ``lax`` decode loop and
with the Rust host kernel, the Pallas kernels: interpreted on CPU, compiled on a GPU)
against a dense float64 attention written from the definitions (transformers'
``sliding_window_overlay``: key ``j`` visible from query ``p`` iff ``p - W < j <= p``;
Gemma 2's ``cap * tanh(x / cap)``; gpt-oss' sink column in the softmax), on ragged
steps mixing prefill chunks and decode rows, GQA, windows smaller and larger than the
KV and not a multiple of the block size.

Blocks wholly outside a row's window may be freed by the scheduler: their block-table
entries may then point anywhere (the scratch block, a block of another row) and their
old pages may be overwritten. ``test_*_ignores_blocks_outside_the_window`` poisons
both and checks the output is bit-identical and finite.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kvpage.kernels import dispatch
from kvpage.kernels.host import cpu_decode_attention
from kvpage.kernels.pallas.paged_decode_attention import paged_decode_attention
from kvpage.kernels.pallas.ragged_paged_attention import ragged_paged_attention
from kvpage.kernels.xla.reference import ragged_paged_attention_reference
from kvpage.kernels.xla.xla_paged_attention import xla_paged_attention
from kvpage.model.attention import get_attention_backend
from test_pallas_kernels import INTERPRET, Case, assert_close, make_case

TOL = {"rtol": 2e-5, "atol": 2e-5}
SM_SCALE = 0.5
BLOCK = 8

# Rows: a prefill chunk with context, a long decode, a decode shorter than every window,
# a prefill chunk spanning blocks, a decode at a block boundary; two padded rows.
Q_LENS = [5, 1, 1, 12, 1]
KV_LENS = [40, 37, 3, 30, 64]

# (sliding_window, logit_soft_cap, sinks): windows below a block, not a multiple of it,
# larger than every kv_len; each feature alone and all together.
OPTIONS = [
    (5, None, False),
    (13, None, False),
    (100, None, False),
    (None, 2.5, False),
    (None, None, True),
    (11, 2.5, True),
]
OPTION_IDS = [f"w{w}-cap{c}-sinks{s}" for w, c, s in OPTIONS]


def _case(seed: int = 0, *, group: int = 3, head_dim: int = 16, dtype=jnp.float32) -> Case:
    return make_case(
        seed, Q_LENS, KV_LENS, num_kv_heads=2, group=group, head_dim=head_dim,
        block_size=BLOCK, pad_rows=2, pad_tokens=3, dtype=dtype,
    )  # fmt: skip


def _sinks(case: Case, on: bool) -> jax.Array | None:
    if not on:
        return None
    heads = case.q.shape[1]
    return jnp.asarray(np.random.default_rng(99).standard_normal(heads) * 2.0, jnp.float32)


def dense_attention(
    case: Case,
    sm_scale: float,
    *,
    sliding_window: int | None = None,
    logit_soft_cap: float | None = None,
    sinks: jax.Array | None = None,
) -> np.ndarray:
    """Float64 attention of each query token over its row's logical KV, from the
    definitions of the three options."""
    q = np.asarray(case.q.astype(jnp.float32), np.float64)
    sink = None if sinks is None else np.asarray(sinks, np.float64)
    out = np.zeros(q.shape, np.float64)
    start = 0
    for s, (ql, kl) in enumerate(zip(case.q_lens_list, case.kv_lens_list, strict=True)):
        if s >= int(case.num_seqs[0]):
            break
        k = case.logical_k[s].astype(np.float64)
        v = case.logical_v[s].astype(np.float64)
        for i in range(ql):
            pos = kl - ql + i
            keys = np.arange(kl)
            visible = keys <= pos
            if sliding_window is not None:
                visible &= keys > pos - sliding_window
            for h in range(q.shape[1]):
                kvh = h // case.group
                scores = k[visible, kvh] @ q[start + i, h] * sm_scale
                if logit_soft_cap is not None:
                    scores = logit_soft_cap * np.tanh(scores / logit_soft_cap)
                top = scores.max() if sink is None else max(scores.max(), sink[h])
                w = np.exp(scores - top)
                denom = w.sum() + (0.0 if sink is None else np.exp(sink[h] - top))
                out[start + i, h] = w @ v[visible, kvh] / denom
        start += ql
    return out


def poison_outside_window(case: Case, window: int, seed: int = 1) -> tuple[jax.Array, ...]:
    """The case's arguments with every block wholly outside its row's window freed and
    reused: its table entry redirected (the scratch block, or a live block of another
    row) and its old page overwritten with NaN."""
    rng = np.random.default_rng(seed)
    tables = np.asarray(case.block_tables).copy()
    k_pages = np.asarray(case.k_pages.astype(jnp.float32)).copy()
    v_pages = np.asarray(case.v_pages.astype(jnp.float32)).copy()
    scratch = k_pages.shape[1] - 1
    freed = 0
    for s, (ql, kl) in enumerate(zip(case.q_lens_list, case.kv_lens_list, strict=True)):
        if s >= int(case.num_seqs[0]) or ql == 0:
            continue
        lowest = max(0, kl - ql - (window - 1))  # the row's first query sees from here
        others = [
            int(tables[r, b])
            for r, n in enumerate(case.kv_lens_list)
            if r != s
            for b in range(-(-n // BLOCK))
        ]
        for b in range(lowest // BLOCK):
            page = tables[s, b]
            k_pages[:, page] = np.nan
            v_pages[:, page] = np.nan
            tables[s, b] = scratch if b % 2 == 0 or not others else rng.choice(others)
            freed += 1
    assert freed > 0, "the case has no block outside a window"
    dtype = case.k_pages.dtype
    return (
        case.q,
        jnp.asarray(k_pages, dtype),
        jnp.asarray(v_pages, dtype),
        case.kv_lens,
        jnp.asarray(tables),
        case.cu_q_lens,
        case.num_seqs,
    )


def _check_poison(fn, case: Case, window: int, **options) -> None:
    clean = np.asarray(fn(*case.args, sliding_window=window, **options))
    poisoned = np.asarray(
        fn(*poison_outside_window(case, window), sliding_window=window, **options)
    )
    assert np.isfinite(poisoned).all(), "an out-of-window block leaked into the output"
    np.testing.assert_array_equal(poisoned, clean)


# --------------------------------------------------------------------------
# The reference, and the dense attention it is checked against.
# --------------------------------------------------------------------------


def test_window_off_by_one_matches_transformers_overlay() -> None:
    masking_utils = pytest.importorskip("transformers.masking_utils")
    overlay = masking_utils.sliding_window_overlay(4)
    # transformers: a query at 10 with window 4 sees 7, 8, 9, 10 (and the causal part).
    seen = [j for j in range(12) if overlay(0, 0, 10, j) and j <= 10]
    assert seen == [7, 8, 9, 10]


@pytest.mark.parametrize(("window", "cap", "sinks"), OPTIONS, ids=OPTION_IDS)
def test_reference_matches_dense(window: int | None, cap: float | None, sinks: bool) -> None:
    case = _case()
    options = dict(sliding_window=window, logit_soft_cap=cap, sinks=_sinks(case, sinks))
    out = ragged_paged_attention_reference(*case.args, sm_scale=SM_SCALE, **options)
    assert_close(out, dense_attention(case, SM_SCALE, **options), TOL)
    assert not np.asarray(out)[sum(Q_LENS) :].any(), "padded tokens must be exact zeros"


def test_reference_ignores_blocks_outside_the_window() -> None:
    fn = functools.partial(ragged_paged_attention_reference, sm_scale=SM_SCALE)
    _check_poison(fn, _case(), 5, logit_soft_cap=2.5)


def test_options_are_checked() -> None:
    case = _case()
    for bad in (dict(sliding_window=0), dict(logit_soft_cap=0.0), dict(sinks=jnp.zeros(5))):
        with pytest.raises(ValueError):
            ragged_paged_attention_reference(*case.args, sm_scale=SM_SCALE, **bad)
        with pytest.raises(ValueError):
            xla_paged_attention(*case.args, sm_scale=SM_SCALE, **bad)


def test_model_backend_passes_options_through() -> None:
    case = _case()
    options = dict(sliding_window=13, logit_soft_cap=2.5, sinks=_sinks(case, True))
    want = dense_attention(case, SM_SCALE, **options)
    for name in ("reference", "xla"):
        backend = get_attention_backend(name)
        out = backend.attend(*case.args, sm_scale=SM_SCALE, decode_only=False, **options)
        assert_close(out, want, TOL)


# --------------------------------------------------------------------------
# The xla backend: the lax loops, and decode rows through the Rust host kernel.
# --------------------------------------------------------------------------


def _xla(host: bool, **knobs):
    return jax.jit(
        functools.partial(xla_paged_attention, sm_scale=SM_SCALE, host_decode_kernel=host, **knobs),
        static_argnames=("sliding_window", "logit_soft_cap"),
    )


SMALL_TILES = dict(q_tile=4, kv_chunk_blocks=2, decode_chunk_blocks=3)


@pytest.mark.parametrize(
    ("window", "cap", "sinks", "knobs"),
    [(*o, {}) for o in OPTIONS] + [(*o, SMALL_TILES) for o in (OPTIONS[0], OPTIONS[-1])],
)
def test_xla_lax_loops_match_dense(
    window: int | None, cap: float | None, sinks: bool, knobs: dict
) -> None:
    """Default tiles, and tiles small enough that prefill tiles start mid-row and
    windows start mid-chunk."""
    case = _case()
    options = dict(sliding_window=window, logit_soft_cap=cap, sinks=_sinks(case, sinks))
    out = _xla(False, **knobs)(*case.args, **options)
    assert_close(out, dense_attention(case, SM_SCALE, **options), TOL)


@pytest.mark.parametrize("knobs", [{}, SMALL_TILES])
def test_xla_ignores_blocks_outside_the_window(knobs: dict) -> None:
    case = _case(2)
    _check_poison(_xla(False, **knobs), case, 5)
    _check_poison(_xla(False, **knobs), case, 13, sinks=_sinks(case, True))


def test_xla_trip_counts_follow_the_window() -> None:
    """1000-token rows (a decode, a 4-token chunk) with a window of 16: the loops start
    at the window's blocks, so table entries below them may be out of range (a gather
    of one would clamp to the garbage-filled scratch block and leak NaN)."""
    case = make_case(
        3, [1, 4], [1000, 1000], num_kv_heads=1, group=2, head_dim=16, block_size=BLOCK,
    )  # fmt: skip
    tables = np.asarray(case.block_tables).copy()
    want = _xla(False)(*case.args, sliding_window=16)
    tables[:, : (1000 - 20) // BLOCK] = 10**6  # any gather of these would clamp: wrong
    got = _xla(False)(*case.args[:4], jnp.asarray(tables), *case.args[5:], sliding_window=16)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert_close(want, dense_attention(case, SM_SCALE, sliding_window=16), TOL)


def test_options_off_trace_no_extra_work() -> None:
    case = _case()

    def jaxpr(fn, **options) -> str:
        return str(jax.make_jaxpr(functools.partial(fn, sm_scale=SM_SCALE, **options))(*case.args))

    xla = functools.partial(xla_paged_attention, host_decode_kernel=False)
    assert jaxpr(xla) == jaxpr(xla, sliding_window=None, logit_soft_cap=None, sinks=None)
    assert "tanh" not in jaxpr(xla) and "tanh" in jaxpr(xla, logit_soft_cap=2.0)
    assert "take_along_axis" not in jaxpr(xla) and "gather" in jaxpr(xla)
    for kernel in (ragged_paged_attention, paged_decode_attention):
        plain = jaxpr(kernel, interpret=True)
        assert "tanh" not in plain
        assert "tanh" in jaxpr(kernel, interpret=True, logit_soft_cap=2.0)


needs_host_kernel = pytest.mark.skipif(
    jax.default_backend() != "cpu"
    or not (cpu_decode_attention.available() and cpu_decode_attention.supports_options()),
    reason="not on CPU, or kvpage._core without the host kernel's options",
)


@needs_host_kernel
@pytest.mark.parametrize(("window", "cap", "sinks"), OPTIONS, ids=OPTION_IDS)
def test_host_kernel_matches_dense(window: int | None, cap: float | None, sinks: bool) -> None:
    case = _case(4)
    options = dict(sliding_window=window, logit_soft_cap=cap, sinks=_sinks(case, sinks))
    fn = _xla(True)
    text = fn.lower(*case.args, **options).as_text()
    assert "kvpage_paged_decode_attention" in text
    out = fn(*case.args, **options)
    assert_close(out, dense_attention(case, SM_SCALE, **options), TOL)


@needs_host_kernel
@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # garbage slots -> inf
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_host_kernel_narrow_pools(dtype) -> None:
    case = _case(5, head_dim=32, dtype=dtype)
    options = dict(sliding_window=11, logit_soft_cap=2.5, sinks=_sinks(case, True))
    out = _xla(True)(*case.args, **options)
    tol = {"rtol": 2e-2, "atol": 2e-2}
    assert_close(out, dense_attention(case, SM_SCALE, **options), tol)
    assert_close(out, _xla(False)(*case.args, **options), tol)


@needs_host_kernel
def test_host_kernel_ignores_blocks_outside_the_window() -> None:
    case = _case(6, group=4)
    _check_poison(_xla(True), case, 5)
    _check_poison(_xla(True), case, 9, logit_soft_cap=2.5, sinks=_sinks(case, True))


@needs_host_kernel
def test_host_kernel_takes_five_operands_without_options() -> None:
    """A decode step without options is the plain five-operand call; a step with
    prefill rows adds the table row of each query token (nine operands)."""
    case = _case()
    decode = make_case(3, [1, 1, 1], [40, 9, 17], num_kv_heads=2, group=2, head_dim=16,
                       block_size=8)
    lower = functools.partial(xla_paged_attention, sm_scale=SM_SCALE)
    plain = jax.jit(functools.partial(lower, decode_only=True)).lower(*decode.args).as_text()
    windowed = jax.jit(functools.partial(lower, decode_only=True, sliding_window=5)).lower(
        *decode.args).as_text()
    mixed = _xla(True).lower(*case.args).as_text()
    call = "custom_call @kvpage_paged_decode_attention("
    assert plain.count(call) == windowed.count(call) == mixed.count(call) == 1

    def operands(text: str) -> int:
        line = text[text.index(call) :].split("\n", 1)[0]
        return line[len(call) :].split(")", 1)[0].count("%")

    assert operands(plain) == 5 and operands(windowed) == 8 and operands(mixed) == 9


# --------------------------------------------------------------------------
# Pallas (interpreted on CPU: a few cases only, they are slow).
# --------------------------------------------------------------------------

PALLAS_OPTIONS = [(5, None, False), (11, 2.5, True)]


@pytest.mark.parametrize(("window", "cap", "sinks"), PALLAS_OPTIONS, ids=str)
def test_pallas_mixed_step_matches_dense(
    window: int | None, cap: float | None, sinks: bool
) -> None:
    case = _case(7, group=4)
    options = dict(sliding_window=window, logit_soft_cap=cap, sinks=_sinks(case, sinks))
    out = dispatch.mixed_paged_attention(
        *case.args, sm_scale=SM_SCALE, interpret=INTERPRET, **options
    )
    assert_close(out, dense_attention(case, SM_SCALE, **options), TOL)


def test_pallas_ragged_alone_matches_dense() -> None:
    """The ragged kernel for every row (decode rows too), small query blocks so an
    item's window start differs from its row's."""
    case = _case(8, group=4)
    options = dict(sliding_window=6, logit_soft_cap=2.5, sinks=_sinks(case, True))
    out = ragged_paged_attention(
        *case.args, sm_scale=SM_SCALE, interpret=INTERPRET, block_q=4, **options
    )
    assert_close(out, dense_attention(case, SM_SCALE, **options), TOL)


def test_pallas_decode_matches_dense() -> None:
    case = make_case(
        9, [1, 1, 1, 1], [70, 3, 33, 16], num_kv_heads=2, group=4, head_dim=16,
        block_size=BLOCK, pad_rows=1, pad_tokens=1,
    )  # fmt: skip
    options = dict(sliding_window=21, logit_soft_cap=2.5, sinks=_sinks(case, True))
    out = paged_decode_attention(
        *case.args, sm_scale=SM_SCALE, interpret=INTERPRET, num_splits=3,
        min_blocks_per_split=1, pages_per_compute_block=2, **options,
    )  # fmt: skip
    assert_close(out, dense_attention(case, SM_SCALE, **options), TOL)


def test_pallas_ignores_blocks_outside_the_window() -> None:
    case = _case(10, group=4)
    fn = functools.partial(dispatch.mixed_paged_attention, sm_scale=SM_SCALE, interpret=INTERPRET)
    _check_poison(fn, case, 5, sinks=_sinks(case, True))
