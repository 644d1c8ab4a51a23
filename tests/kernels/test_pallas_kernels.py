"""Tests of the paged-attention kernels against the contract in ``reference.py``.

On CPU the Pallas kernels run with ``interpret=True``; on a GPU machine the
same tests exercise the compiled Triton kernels. Every unused KV slot and
every page an unused block-table entry points at is filled with garbage
(NaN, +-inf, 1e30), and padded query tokens hold NaN, so any read outside a
row's ``kv_len`` (or of a padded token) shows up in the output.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kvpage import kernels as pallas_kernels
from kvpage.kernels import dispatch
from kvpage.kernels.pallas._compat import on_gpu
from kvpage.kernels.pallas.paged_decode_attention import (
    auto_num_splits,
    combine_splits,
    paged_decode_attention,
)
from kvpage.kernels.pallas.ragged_paged_attention import (
    build_work_items,
    max_work_items,
    ragged_paged_attention,
)
from kvpage.kernels.xla.reference import ragged_paged_attention_reference

INTERPRET = not on_gpu()
F32_TOL = {"rtol": 1e-5, "atol": 1e-5}
BF16_TOL = {"rtol": 2e-2, "atol": 2e-2}
GARBAGE = np.array([np.nan, 1e30, np.inf, -1e30, -np.inf], dtype=np.float32)


@dataclass
class Case:
    """One attention call: device inputs plus the logical (unpaged) K/V per row."""

    q: jax.Array
    k_pages: jax.Array
    v_pages: jax.Array
    kv_lens: jax.Array
    block_tables: jax.Array
    cu_q_lens: jax.Array
    num_seqs: jax.Array
    q_lens_list: list[int]
    kv_lens_list: list[int]
    logical_k: list[np.ndarray]  # row s: [kv_len, Hkv, D]
    logical_v: list[np.ndarray]
    group: int

    @property
    def args(self) -> tuple[jax.Array, ...]:
        return (
            self.q,
            self.k_pages,
            self.v_pages,
            self.kv_lens,
            self.block_tables,
            self.cu_q_lens,
            self.num_seqs,
        )


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_case(
    seed: int,
    q_lens: list[int],
    kv_lens: list[int],
    *,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    pad_rows: int = 0,
    pad_tokens: int = 0,
    dtype: jnp.dtype = jnp.float32,
) -> Case:
    """Random paged inputs; everything outside the rows' valid KV is garbage."""
    rng = np.random.default_rng(seed)
    q_lens = list(q_lens) + [0] * pad_rows
    kv_lens = list(kv_lens) + [0] * pad_rows
    num_seqs = len(q_lens) - pad_rows
    num_rows = len(q_lens)
    hkv, d, b = num_kv_heads, head_dim, block_size
    used = [_cdiv(n, b) for n in kv_lens]
    max_blocks = max(used) + 2  # every row has unused block-table entries
    garbage_pages = 3
    num_pages = sum(used) + garbage_pages + 1  # + the scratch block (id P - 1)

    shape = (hkv, num_pages, b, d)
    pattern = GARBAGE[rng.integers(0, len(GARBAGE), size=shape)]
    k_pool = pattern.copy()
    v_pool = GARBAGE[rng.integers(0, len(GARBAGE), size=shape)]

    order = rng.permutation(num_pages - 1)  # never hand out the scratch block
    valid_pages, junk_pages = order[: sum(used)], order[sum(used) :]
    junk_pages = np.concatenate([junk_pages, [num_pages - 1]])
    tables = np.zeros((num_rows, max_blocks), np.int32)
    logical_k, logical_v = [], []
    cursor = 0
    for s, n in enumerate(kv_lens):
        pages = valid_pages[cursor : cursor + used[s]]
        cursor += used[s]
        tables[s, : used[s]] = pages
        tables[s, used[s] :] = rng.choice(junk_pages, size=max_blocks - used[s])
        lk = rng.standard_normal((n, hkv, d)).astype(np.float32)
        lv = rng.standard_normal((n, hkv, d)).astype(np.float32)
        if dtype != jnp.float32:  # keep the logical copy exactly what the pool holds
            lk = np.asarray(jnp.asarray(lk, dtype).astype(jnp.float32))
            lv = np.asarray(jnp.asarray(lv, dtype).astype(jnp.float32))
        for pos in range(n):
            page, off = pages[pos // b], pos % b
            k_pool[:, page, off] = lk[pos]
            v_pool[:, page, off] = lv[pos]
        logical_k.append(lk)
        logical_v.append(lv)

    num_tokens = sum(q_lens) + pad_tokens
    q = rng.standard_normal((num_tokens, hkv * group, d)).astype(np.float32)
    q[sum(q_lens) :] = np.nan  # padded tokens must never be read
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return Case(
        q=jnp.asarray(q, dtype),
        k_pages=jnp.asarray(k_pool, dtype),
        v_pages=jnp.asarray(v_pool, dtype),
        kv_lens=jnp.asarray(kv_lens, jnp.int32),
        block_tables=jnp.asarray(tables),
        cu_q_lens=jnp.asarray(cu),
        num_seqs=jnp.asarray([num_seqs], jnp.int32),
        q_lens_list=q_lens,
        kv_lens_list=kv_lens,
        logical_k=logical_k,
        logical_v=logical_v,
        group=group,
    )


def naive_attention(case: Case, sm_scale: float) -> np.ndarray:
    """Per-token, per-head float64 softmax attention over the logical KV."""
    q = np.asarray(case.q.astype(jnp.float32), np.float64)
    out = np.zeros(q.shape, np.float64)
    num_seqs = int(case.num_seqs[0])
    start = 0
    for s, (ql, kl) in enumerate(zip(case.q_lens_list, case.kv_lens_list, strict=True)):
        if s >= num_seqs:
            break
        k = case.logical_k[s].astype(np.float64)
        v = case.logical_v[s].astype(np.float64)
        for i in range(ql):
            pos = kl - ql + i
            if pos < 0:
                continue
            for h in range(q.shape[1]):
                kvh = h // case.group
                scores = k[: pos + 1, kvh] @ q[start + i, h] * sm_scale
                w = np.exp(scores - scores.max())
                out[start + i, h] = (w / w.sum()) @ v[: pos + 1, kvh]
        start += ql
    return out


def assert_close(
    actual: jax.Array, expected: np.ndarray | jax.Array, tol: dict[str, float]
) -> None:
    actual_np = np.asarray(jnp.asarray(actual).astype(jnp.float32))
    expected_np = np.asarray(jnp.asarray(expected).astype(jnp.float32))
    assert np.isfinite(actual_np).all(), "non-finite values leaked into the output"
    np.testing.assert_allclose(actual_np, expected_np, **tol)


def _reference(case: Case, sm_scale: float) -> jax.Array:
    return ragged_paged_attention_reference(*case.args, sm_scale=sm_scale)


# --------------------------------------------------------------------------
# The reference itself, pinned by an independent naive implementation.
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("block_size", "num_kv_heads", "group"),
    [(8, 2, 1), (16, 1, 4), (8, 2, 3)],
)
def test_reference_matches_naive(block_size: int, num_kv_heads: int, group: int) -> None:
    case = make_case(
        0,
        q_lens=[5, 1, 0, 8, 1],
        kv_lens=[13, 16, 7, 8, 1],
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=64,
        block_size=block_size,
        pad_rows=2,
        pad_tokens=3,
    )
    sm_scale = 0.3
    assert_close(_reference(case, sm_scale), naive_attention(case, sm_scale), F32_TOL)
    # Padded tokens are exact zeros.
    real = int(case.cu_q_lens[int(case.num_seqs[0])])
    assert not np.asarray(_reference(case, sm_scale))[real:].any()


# --------------------------------------------------------------------------
# Ragged kernel.
# --------------------------------------------------------------------------

RAGGED_CASES = [
    # MHA, a mid-sequence prefill chunk, a decode at an exact block multiple,
    # a live row with no queries, a from-scratch prefill, padded rows + tokens.
    dict(
        q_lens=[5, 1, 0, 8, 1],
        kv_lens=[13, 16, 7, 8, 1],
        num_kv_heads=2,
        group=1,
        head_dim=64,
        block_size=8,
        pad_rows=2,
        pad_tokens=3,
        block_q=16,
        pages=2,
    ),
    # GQA 4, head_dim 128, a chunk spanning several query blocks.
    dict(
        q_lens=[1, 9, 3],
        kv_lens=[32, 20, 3],
        num_kv_heads=1,
        group=4,
        head_dim=128,
        block_size=16,
        pad_rows=1,
        pad_tokens=2,
        block_q=4,
        pages=1,
    ),
    # GQA 8, several pages per compute block.
    dict(
        q_lens=[2, 1, 6],
        kv_lens=[24, 9, 6],
        num_kv_heads=1,
        group=8,
        head_dim=64,
        block_size=8,
        pad_rows=0,
        pad_tokens=1,
        block_q=2,
        pages=4,
    ),
    # Group of 3 query heads (padded to 4 inside the kernel).
    dict(
        q_lens=[4, 1],
        kv_lens=[17, 32],
        num_kv_heads=2,
        group=3,
        head_dim=64,
        block_size=16,
        pad_rows=1,
        pad_tokens=0,
        block_q=4,
        pages=1,
    ),
    # The kernel's default tiling.
    dict(
        q_lens=[3, 1, 12],
        kv_lens=[40, 64, 12],
        num_kv_heads=2,
        group=4,
        head_dim=128,
        block_size=16,
        pad_rows=1,
        pad_tokens=4,
        block_q=None,
        pages=None,
    ),
]


def _ragged(case: Case, sm_scale: float, block_q: int | None, pages: int | None) -> jax.Array:
    return ragged_paged_attention(
        *case.args,
        sm_scale=sm_scale,
        interpret=INTERPRET,
        block_q=block_q,
        pages_per_compute_block=pages,
    )


@pytest.mark.parametrize("params", RAGGED_CASES, ids=lambda p: f"B{p['block_size']}G{p['group']}")
def test_ragged_matches_reference_f32(params: dict) -> None:
    params = dict(params)
    block_q, pages = params.pop("block_q"), params.pop("pages")
    case = make_case(1, **params)
    sm_scale = 1.0 / np.sqrt(params["head_dim"])
    out = _ragged(case, sm_scale, block_q, pages)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    assert_close(out, _reference(case, sm_scale), F32_TOL)
    real = sum(case.q_lens_list)
    assert not np.asarray(out)[real:].any(), "padded tokens must be exact zeros"
    assert (np.abs(np.asarray(out)[:real]).sum(axis=-1) > 0.0).all()


def test_ragged_matches_reference_bf16() -> None:
    params = dict(RAGGED_CASES[1])
    block_q, pages = params.pop("block_q"), params.pop("pages")
    case = make_case(2, **params, dtype=jnp.bfloat16)
    out = _ragged(case, 0.125, block_q, pages)
    assert out.dtype == jnp.bfloat16
    assert_close(out, _reference(case, 0.125), BF16_TOL)


def test_ragged_ignores_block_table_tail_and_pool_garbage() -> None:
    """Changing anything the contract says must not be read leaves the output unchanged."""
    params = dict(RAGGED_CASES[0])
    block_q, pages = params.pop("block_q"), params.pop("pages")
    case = make_case(4, **params)
    first = _ragged(case, 0.2, block_q, pages)
    tables = np.asarray(case.block_tables).copy()
    used = [_cdiv(n, params["block_size"]) for n in case.kv_lens_list]
    for s, u in enumerate(used):
        tables[s, u:] = case.k_pages.shape[1] - 1  # all point at the scratch block now
    k_pages = case.k_pages.at[:, -1].set(jnp.nan)
    v_pages = case.v_pages.at[:, -1].set(jnp.inf)
    again = ragged_paged_attention(
        case.q,
        k_pages,
        v_pages,
        case.kv_lens,
        jnp.asarray(tables),
        case.cu_q_lens,
        case.num_seqs,
        sm_scale=0.2,
        interpret=INTERPRET,
        block_q=block_q,
        pages_per_compute_block=pages,
    )
    np.testing.assert_array_equal(np.asarray(first), np.asarray(again))


def test_work_items_cover_every_query_block_once() -> None:
    cu = jnp.asarray([0, 5, 6, 6, 14, 15, 15], jnp.int32)  # q_lens 5, 1, 0, 8, 1, 0
    num_seqs = jnp.asarray([5], jnp.int32)
    block_q = 4
    n = max_work_items(18, 6, block_q)
    rows, qblks = (
        np.asarray(x) for x in build_work_items(cu, num_seqs, block_q=block_q, num_items=n)
    )
    live = [(int(r), int(b)) for r, b in zip(rows, qblks, strict=True) if r >= 0]
    assert live == [(0, 0), (0, 1), (1, 0), (3, 0), (3, 1), (4, 0)]
    assert (rows[len(live) :] == -1).all()
    # Rows past num_seqs get no work even if (wrongly) given queries.
    rows, _ = build_work_items(cu, jnp.asarray([3], jnp.int32), block_q=block_q, num_items=n)
    assert set(np.asarray(rows).tolist()) == {0, 1, -1}


def test_max_work_items_is_an_upper_bound() -> None:
    rng = np.random.default_rng(5)
    for _ in range(200):
        rows = int(rng.integers(1, 9))
        q_lens = rng.integers(0, 10, size=rows)
        tokens = int(q_lens.sum()) + int(rng.integers(0, 3))
        for block_q in (1, 2, 4, 8):
            need = int(sum(_cdiv(int(x), block_q) for x in q_lens))
            assert need <= max_work_items(max(tokens, 1), rows, block_q)


def test_ragged_rejects_tiles_triton_cannot_dot() -> None:
    case = make_case(6, [1], [5], num_kv_heads=1, group=1, head_dim=64, block_size=8)
    with pytest.raises(ValueError, match=">= 16"):
        _ragged(case, 0.1, 4, 2)  # 4-row query tile
    with pytest.raises(ValueError, match=">= 16"):
        _ragged(case, 0.1, 16, 1)  # 8-token KV block
    with pytest.raises(ValueError, match="power"):
        _ragged(case, 0.1, 24, 2)


# --------------------------------------------------------------------------
# Decode kernel.
# --------------------------------------------------------------------------

DECODE_CASES = [
    # (q_lens, kv_lens, Hkv, group, head_dim, block_size, pad_rows, pad_tokens, splits, pages)
    ([1, 1, 1, 1], [13, 16, 1, 40], 2, 1, 64, 8, 2, 1, 1, 2),
    ([1, 1, 1, 1], [13, 16, 1, 40], 2, 1, 64, 8, 2, 1, 3, 2),
    ([1, 1, 1], [33, 64, 5], 1, 8, 128, 16, 1, 0, None, 1),
    ([1, 1, 1], [48, 7, 16], 2, 4, 64, 16, 0, 2, 2, 1),
    # A live row with q_len 0 (KV kept, nothing decoded) and a group of 3.
    ([1, 0, 1], [20, 12, 31], 1, 3, 64, 8, 1, 1, 4, 2),
]


@pytest.mark.parametrize(
    (
        "q_lens",
        "kv_lens",
        "hkv",
        "group",
        "head_dim",
        "block_size",
        "pad_rows",
        "pad_tokens",
        "splits",
        "pages",
    ),
    DECODE_CASES,
)
def test_decode_matches_reference(
    q_lens: list[int],
    kv_lens: list[int],
    hkv: int,
    group: int,
    head_dim: int,
    block_size: int,
    pad_rows: int,
    pad_tokens: int,
    splits: int | None,
    pages: int,
) -> None:
    case = make_case(
        7,
        q_lens=q_lens,
        kv_lens=kv_lens,
        num_kv_heads=hkv,
        group=group,
        head_dim=head_dim,
        block_size=block_size,
        pad_rows=pad_rows,
        pad_tokens=pad_tokens,
    )
    sm_scale = 1.0 / np.sqrt(head_dim)
    out = paged_decode_attention(
        *case.args,
        sm_scale=sm_scale,
        interpret=INTERPRET,
        num_splits=splits,
        pages_per_compute_block=pages,
    )
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    assert_close(out, _reference(case, sm_scale), F32_TOL)
    assert not np.asarray(out)[sum(q_lens) :].any(), "padded tokens must be exact zeros"


def test_decode_matches_reference_bf16() -> None:
    case = make_case(
        8,
        q_lens=[1, 1, 1],
        kv_lens=[50, 3, 32],
        num_kv_heads=2,
        group=4,
        head_dim=128,
        block_size=16,
        pad_rows=1,
        pad_tokens=1,
        dtype=jnp.bfloat16,
    )
    out = paged_decode_attention(
        *case.args, sm_scale=0.1, interpret=INTERPRET, num_splits=2, pages_per_compute_block=1
    )
    assert out.dtype == jnp.bfloat16
    assert_close(out, _reference(case, 0.1), BF16_TOL)


def test_combine_splits_equals_unsplit_softmax() -> None:
    rng = np.random.default_rng(9)
    scores = rng.standard_normal((12,)) * 3
    values = rng.standard_normal((12, 4))
    full = np.exp(scores - scores.max()) @ values / np.exp(scores - scores.max()).sum()
    parts, lses = [], []
    for chunk in (slice(0, 5), slice(5, 5), slice(5, 12)):  # one empty split
        s, v = scores[chunk], values[chunk]
        if s.size == 0:
            parts.append(np.zeros(4))
            lses.append(-np.inf)
            continue
        w = np.exp(s - s.max())
        parts.append(w @ v / w.sum())
        lses.append((s.max() + np.log(w.sum())) / np.log(2.0))
    merged = combine_splits(
        jnp.asarray(np.stack(parts), jnp.float32), jnp.asarray(lses, jnp.float32)
    )
    np.testing.assert_allclose(np.asarray(merged), full, rtol=1e-5, atol=1e-6)
    empty = combine_splits(jnp.zeros((3, 4)), jnp.full((3,), -jnp.inf))
    assert not np.asarray(empty).any() and np.isfinite(np.asarray(empty)).all()


def test_auto_num_splits() -> None:
    assert auto_num_splits(1, 8, 256, 8) == 16  # few programs: split up to the cap
    assert auto_num_splits(64, 8, 256, 8) == 1  # already 512 programs
    assert auto_num_splits(2, 1, 3, 1) == 3  # never more splits than compute blocks
    assert auto_num_splits(4, 2, 1, 1) == 1


# --------------------------------------------------------------------------
# Dispatcher.
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mixed_case() -> Case:
    return make_case(10, [3, 1], [11, 8], num_kv_heads=1, group=4, head_dim=64, block_size=8)


def test_dispatch_reference_backend_is_the_reference(
    mixed_case: Case, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Checked against the independent float64 attention, not against the function the
    # dispatcher calls; and no other kernel may serve the "reference" route.
    def not_this_one(*args: object, **kwargs: object) -> None:
        raise AssertionError("backend='reference' ran another kernel")

    for name in ("ragged_paged_attention", "paged_decode_attention", "xla_paged_attention"):
        if hasattr(dispatch, name):
            monkeypatch.setattr(dispatch, name, not_this_one)
    out = pallas_kernels.paged_attention(*mixed_case.args, sm_scale=0.2, backend="reference")
    assert_close(out, naive_attention(mixed_case, 0.2), F32_TOL)


def test_dispatch_default_backend_follows_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dispatch, "on_gpu", lambda: False)
    assert dispatch.resolve_backend(None) == "xla"
    monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
    assert dispatch.resolve_backend(None) == "pallas"
    assert dispatch.resolve_backend("reference") == "reference"


def _spy(calls: list[tuple[str, dict]], name: str) -> Callable[..., str]:
    def fn(*args: jax.Array, **kwargs: object) -> str:
        calls.append((name, kwargs))
        return name

    return fn


@pytest.mark.parametrize(
    ("backend", "gpu", "decode_only", "expected", "interpret"),
    [
        (None, False, False, "xla", None),
        (None, False, True, "xla", None),
        ("xla", True, True, "xla", None),
        (None, True, False, "mixed", False),
        (None, True, True, "decode", False),
        ("pallas", False, False, "mixed", True),
        ("pallas", False, True, "decode", True),
        ("reference", True, True, "reference", None),
    ],
)
def test_dispatch_routes(
    monkeypatch: pytest.MonkeyPatch,
    mixed_case: Case,
    backend: str | None,
    gpu: bool,
    decode_only: bool,
    expected: str,
    interpret: bool | None,
) -> None:
    calls: list[tuple[str, dict]] = []
    monkeypatch.setattr(dispatch, "on_gpu", lambda: gpu)
    monkeypatch.setattr(dispatch, "ragged_paged_attention", _spy(calls, "ragged"))
    monkeypatch.setattr(dispatch, "paged_decode_attention", _spy(calls, "decode"))
    monkeypatch.setattr(dispatch, "mixed_paged_attention", _spy(calls, "mixed"))
    monkeypatch.setattr(dispatch, "ragged_paged_attention_reference", _spy(calls, "reference"))
    monkeypatch.setattr(dispatch, "xla_paged_attention", _spy(calls, "xla"))
    result = dispatch.paged_attention(
        *mixed_case.args, sm_scale=0.5, backend=backend, decode_only=decode_only
    )
    assert result == expected
    [(name, kwargs)] = calls
    assert kwargs["sm_scale"] == 0.5
    assert kwargs.get("interpret") is interpret


def test_dispatch_pallas_runs_the_kernels(mixed_case: Case) -> None:
    expected = _reference(mixed_case, 0.2)
    out = pallas_kernels.paged_attention(*mixed_case.args, sm_scale=0.2, backend="pallas")
    assert_close(out, expected, F32_TOL)


def test_mixed_step_gives_decode_rows_split_k() -> None:
    # Prefill rows (q_len 5, 3), decode rows with long and short KV, a padded row.
    case = make_case(
        12, [5, 1, 3, 1], [40, 70, 9, 5], num_kv_heads=2, group=2, head_dim=64,
        block_size=8, pad_rows=1, pad_tokens=2,
    )  # fmt: skip
    calls: list[str] = []
    real_decode = dispatch.paged_decode_attention

    def decode_spy(*args: jax.Array, **kwargs: object) -> jax.Array:
        calls.append("decode")
        return real_decode(*args, **kwargs)

    sm_scale = 0.125
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dispatch, "paged_decode_attention", decode_spy)
        out = dispatch.mixed_paged_attention(*case.args, sm_scale=sm_scale, interpret=INTERPRET)
    assert calls == ["decode"]
    assert_close(out, _reference(case, sm_scale), F32_TOL)
    assert not np.asarray(out)[10:].any(), "padded tokens must be exact zeros"


@pytest.mark.parametrize("min_blocks", [1, 3])
def test_decode_split_plan_follows_live_lengths(min_blocks: int) -> None:
    # 8 grid splits, rows of 1..9 compute blocks: each row plans its own split count.
    case = make_case(
        13, [1, 1, 1], [150, 9, 70], num_kv_heads=1, group=4, head_dim=32, block_size=16,
    )  # fmt: skip
    out = paged_decode_attention(
        *case.args, sm_scale=0.2, interpret=INTERPRET, num_splits=8,
        min_blocks_per_split=min_blocks, pages_per_compute_block=1,
    )  # fmt: skip
    assert_close(out, _reference(case, 0.2), F32_TOL)


@pytest.mark.parametrize("backend", ["triton", "Pallas", "", "gpu"])
def test_dispatch_unknown_backend_raises(mixed_case: Case, backend: str) -> None:
    with pytest.raises(ValueError, match="'reference', 'xla', 'pallas'"):
        pallas_kernels.paged_attention(*mixed_case.args, sm_scale=0.2, backend=backend)


# --------------------------------------------------------------------------
# GPU lowering, checked from CPU: the kernels must lower to Triton IR.
# --------------------------------------------------------------------------


@pytest.mark.parametrize("kernel", ["ragged", "decode"])
def test_kernels_lower_to_triton(kernel: str) -> None:
    pytest.importorskip("jaxlib.triton")
    hkv, group, d, b, pages, rows, max_blocks = 8, 4, 128, 16, 512, 8, 32
    sds = jax.ShapeDtypeStruct
    args = (
        sds((rows * 4, hkv * group, d), jnp.bfloat16),
        sds((hkv, pages, b, d), jnp.bfloat16),
        sds((hkv, pages, b, d), jnp.bfloat16),
        sds((rows,), jnp.int32),
        sds((rows, max_blocks), jnp.int32),
        sds((rows + 1,), jnp.int32),
        sds((1,), jnp.int32),
    )
    fn = ragged_paged_attention if kernel == "ragged" else paged_decode_attention
    lowered = jax.jit(functools.partial(fn, sm_scale=0.1)).trace(*args)
    text = lowered.lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text
