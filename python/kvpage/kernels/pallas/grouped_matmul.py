"""Grouped (ragged) matmul for mixture-of-experts layers as a Pallas (Triton) kernel.

Owns :func:`grouped_matmul` and its weight-only int8 twin :func:`grouped_int8_matmul`:
``x [M, K]`` holds rows sorted by expert, group ``e`` owning rows
``sum(group_sizes[:e]) ..+ group_sizes[e]``; each row is multiplied by its expert's
weight ``w[e]`` stored ``[N, K]`` (HF ``[out, in]``). Rows past ``sum(group_sizes)`` are
padding and come back as zeros. Semantics are those of
``jax.lax.ragged_dot(x, w.transpose(0, 2, 1), group_sizes)``; ``group_sizes`` is a device
array (its values are unknown at trace time).

Work decomposition
------------------
* Rows are cut into ``block_m`` tiles. A *work item* is one (row tile, group) pair that
  share at least one row: a tile lying inside one group is one item, a tile that a group
  boundary crosses is one item per group it touches. Rows past the total form a last
  pseudo-group (number ``E``) whose items multiply nothing and store zeros, so the output
  needs no zero-initialised buffer. At most ``ceil(M / block_m) + E`` items exist, the
  static grid bound; unused tail items have an empty row range and do nothing.
* The wrapper builds the item list with a few tiny jnp ops (a ``compare_all``
  ``searchsorted`` over the per-group tile counts, the ``build_work_items`` pattern of the
  ragged attention kernel) and passes it as a plain ``[4, items]`` int32 input read with
  scalar loads: the Triton backend has no scalar prefetch.
* Grid ``(items, N / block_n)``. Program ``(i, j)`` loads its item's group, tile and row
  range, walks ``K`` in ``block_k`` steps loading only rows of its group (masked loads:
  other groups' rows and rows past ``M`` read nothing), multiplies them by its expert's
  ``[block_n, block_k]`` weight tile with float32 accumulation, and stores only its
  group's rows (masked store). Each expert's weights are read once per item of its group,
  never for a group with no rows.

Tiles: ``block_m`` (16..128, from the mean rows per group; 128 x 128 tiles on 8 warps
for large groups of 2-byte operands, :func:`default_tiles`), ``block_n`` and ``block_k``
are powers of two >= 16 (``tl.dot``'s minimum) dividing ``N`` and ``K``; when none does,
the weight is zero-padded (a copy, avoided for usual model widths). float32 dots use
``Precision.HIGHEST`` (IEEE, not TF32) like the attention kernels. ``interpret=None``
compiles on a GPU (or inside ``kernels.dispatch.compiled_kernels()``) and runs the
Pallas interpreter elsewhere; the Triton build for sm_90a is checked on a CPU machine
(``tests/kernels/test_gpu_build.py``).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kvpage.kernels.pallas._compat import (
    is_power_of_2,
    masked_load,
    masked_store,
    next_power_of_2,
    triton_compiler_params,
)

_DOT_NT = (((1,), (1,)), ((), ()))  # [M, K] x [N, K] -> [M, N]
_PRECISION = lax.Precision.HIGHEST  # exact float32 dots; bf16 dots are unaffected


def _divisor_block(size: int, largest: int) -> int | None:
    """Largest power of two in ``[16, largest]`` dividing ``size``; None if there is none."""
    block = largest
    while block >= 16:
        if size % block == 0:
            return block
        block //= 2
    return None


def default_block_m(rows: int, groups: int, *, itemsize: int = 2) -> int:
    """Rows per tile: the mean rows per group as a power of two, clipped to [16, 128]
    ([16, 64] for 4-byte operands, whose 128-row tiles overflow shared memory)."""
    largest = 128 if itemsize <= 2 else 64
    return max(16, min(largest, next_power_of_2(max(1, rows // max(1, groups)))))


def default_tiles(rows: int, groups: int, n: int, itemsize: int) -> tuple[int, int, int]:
    """``(block_m, block_n, num_warps)`` for ``rows`` rows over ``groups`` experts.

    Measured on an H100 (bf16, Qwen3-30B-A3B and Mixtral-8x7B expert shapes, 64 to 4096
    rows): 128-row groups want 128 x 128 tiles on 8 warps (Mixtral, 4096 rows: 1.10 ms
    against 1.83 ms with 64 x 64 on 4 warps); smaller groups do best with 64-wide out
    tiles on 4 warps.
    """
    block_m = default_block_m(rows, groups, itemsize=itemsize)
    if block_m == 128 and n % 128 == 0:
        return block_m, 128, 8
    return block_m, _divisor_block(n, 64) or 64, 4


def max_work_items(rows: int, groups: int, block_m: int) -> int:
    """Static bound of the work items: every tile once, plus one per group boundary."""
    return max(1, -(-rows // block_m) + groups)


def build_work_items(
    group_sizes: jax.Array, rows: int, *, block_m: int, num_items: int
) -> jax.Array:
    """``[4, num_items]`` int32: each item's group, row tile, first row and end row.

    Groups are ``0 .. E - 1`` plus the pseudo-group ``E`` of the padding rows past
    ``sum(group_sizes)``; group bounds are clipped to ``[0, rows]``. Unused tail items
    get group ``E`` and an empty row range.
    """
    num_groups = group_sizes.shape[0]
    ends = jnp.clip(jnp.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0)), 0, rows)
    ends = jnp.concatenate([ends, jnp.full((1,), rows, jnp.int32)]).astype(jnp.int32)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    first = starts // block_m
    tiles = jnp.where(ends > starts, (ends - 1) // block_m - first + 1, 0).astype(jnp.int32)
    item_ends = jnp.cumsum(tiles).astype(jnp.int32)
    item_starts = item_ends - tiles
    items = jnp.arange(num_items, dtype=jnp.int32)
    # compare_all: one fused kernel. The default "scan" method is a loop that cost about
    # 200 us per call on an H100 (Qwen3-30B-A3B expert shape, 64 rows: 287 -> 87 us).
    found = jnp.searchsorted(item_ends, items, side="right", method="compare_all")
    group = jnp.minimum(found, num_groups)
    group = group.astype(jnp.int32)
    valid = items < item_ends[-1]
    tile = jnp.where(valid, first[group] + items - item_starts[group], 0)
    lo = jnp.where(valid, starts[group], 0)
    hi = jnp.where(valid, ends[group], 0)
    group = jnp.where(valid, group, num_groups)
    return jnp.stack([group, tile, lo, hi]).astype(jnp.int32)


def _kernel(
    items_ref: Any,  # [4, items] int32: group, row tile, first row, end row
    x_ref: Any,  # [M, K]
    w_ref: Any,  # [E, N, K] (float, or int8 with scale_ref)
    *refs: Any,  # ([E, N] float32 scales,) then the [M, N] output
    num_groups: int,
    block_m: int,
    block_n: int,
    block_k: int,
    steps: int,
    compute_dtype: Any,
) -> None:
    scale_ref, o_ref = refs if len(refs) == 2 else (None, refs[0])
    item, j = pl.program_id(0), pl.program_id(1)
    group = items_ref[0, item]
    tile = items_ref[1, item]
    lo = items_ref[2, item]
    hi = items_ref[3, item]
    expert = jnp.minimum(group, num_groups - 1)  # the padding pseudo-group multiplies nothing
    row = tile * block_m + jnp.arange(block_m, dtype=jnp.int32)
    mine = (row >= lo) & (row < hi)
    rows, outs = pl.ds(tile * block_m, block_m), pl.ds(j * block_n, block_n)
    x_mask = jnp.broadcast_to(mine[:, None], (block_m, block_k))

    def step(k: jax.Array, acc: jax.Array) -> jax.Array:
        cols = pl.ds(k * block_k, block_k)
        x = masked_load(x_ref, (rows, cols), mask=x_mask, other=0).astype(compute_dtype)
        w = w_ref[expert, outs, cols].astype(compute_dtype)
        return acc + lax.dot_general(
            x, w, _DOT_NT, precision=_PRECISION, preferred_element_type=jnp.float32
        )

    # Arithmetic, not jnp.where: Triton's lowering types a select of two literals as i1.
    n_steps = (group < num_groups).astype(jnp.int32) * steps
    acc = lax.fori_loop(0, n_steps, step, jnp.zeros((block_m, block_n), jnp.float32))
    if scale_ref is not None:
        acc = acc * scale_ref[expert, outs][None, :]
    out_mask = jnp.broadcast_to(mine[:, None], (block_m, block_n))
    masked_store(o_ref, (rows, outs), acc.astype(o_ref.dtype), mask=out_mask)


@functools.partial(
    jax.jit,
    static_argnames=("out_dtype", "block_m", "block_n", "num_warps", "num_stages", "interpret"),
)
def _grouped_matmul(
    x: jax.Array,
    w: jax.Array,
    scale: jax.Array | None,
    group_sizes: jax.Array,
    *,
    out_dtype: Any,
    block_m: int | None,
    block_n: int | None,
    num_warps: int | None,
    num_stages: int,
    interpret: bool,
) -> jax.Array:
    m, k = x.shape
    num_groups, n, k_w = w.shape
    if k_w != k:
        raise ValueError(f"x [{m}, {k}] and w {w.shape} disagree on K (w is [E, N, K])")
    if group_sizes.shape != (num_groups,):
        raise ValueError(f"group_sizes must be [{num_groups}], got {group_sizes.shape}")
    if scale is not None and scale.shape != (num_groups, n):
        raise ValueError(f"scale must be [{num_groups}, {n}], got {scale.shape}")
    itemsize = max(x.dtype.itemsize, 1 if scale is not None else w.dtype.itemsize)
    auto_m, auto_n, auto_warps = default_tiles(m, num_groups, n, itemsize)
    block_m = auto_m if block_m is None else block_m
    block_n = auto_n if block_n is None else block_n
    num_warps = auto_warps if num_warps is None else num_warps
    if not (is_power_of_2(block_m) and is_power_of_2(block_n)) or min(block_m, block_n) < 16:
        raise ValueError(f"{block_m=} and {block_n=} must be powers of two >= 16 (tl.dot)")
    block_k = _divisor_block(k, 128)
    if block_k is None:  # zero-pad K (a copy; model widths are multiples of 16)
        block_k = 16
        k_pad = -(-k // 16) * 16
        x = jnp.pad(x, ((0, 0), (0, k_pad - k)))
        w = jnp.pad(w, ((0, 0), (0, 0), (0, k_pad - k)))
        k = k_pad
    n_pad = -(-n // block_n) * block_n
    if n_pad != n:  # zero-pad N (a copy of the weights; avoided when block_n divides N)
        w = jnp.pad(w, ((0, 0), (0, n_pad - n), (0, 0)))
        if scale is not None:
            scale = jnp.pad(scale, ((0, 0), (0, n_pad - n)))
    if m == 0:
        return jnp.zeros((0, n), out_dtype)

    num_items = max_work_items(m, num_groups, block_m)
    items = build_work_items(group_sizes, m, block_m=block_m, num_items=num_items)
    if scale is None:
        compute_dtype = jnp.promote_types(x.dtype, w.dtype)
        operands: tuple[jax.Array, ...] = (items, x, w)
    else:
        compute_dtype = x.dtype
        operands = (items, x, w, scale.astype(jnp.float32))
    kernel = functools.partial(
        _kernel,
        num_groups=num_groups,
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        steps=k // block_k,
        compute_dtype=compute_dtype,
    )

    def whole(shape: tuple[int, ...]) -> pl.BlockSpec:
        origin = (0,) * len(shape)
        return pl.BlockSpec(shape, lambda i, j: origin)

    tag = "grouped_int8_matmul" if scale is not None else "grouped_matmul"
    out = pl.pallas_call(
        kernel,
        grid=(num_items, n_pad // block_n),
        in_specs=[whole(a.shape) for a in operands],
        out_specs=whole((m, n_pad)),
        out_shape=jax.ShapeDtypeStruct((m, n_pad), out_dtype),
        interpret=interpret,
        compiler_params=triton_compiler_params(num_warps, num_stages),
        name=f"{tag}_m{block_m}_n{block_n}_k{block_k}",
    )(*operands)
    return out if n_pad == n else out[:, :n]


def _resolve(interpret: bool | None) -> bool:
    if interpret is not None:
        return bool(interpret)
    from kvpage.kernels.dispatch import interpret_default  # dispatch imports the kernels

    return interpret_default()


def grouped_matmul(
    x: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    *,
    preferred_element_type: Any = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 3,
    interpret: bool | None = None,
) -> jax.Array:
    """``y[r] = x[r] . w[group(r)]^T``: the MoE expert matmul over rows sorted by expert.

    Args:
      x: ``[M, K]`` rows sorted by expert (bfloat16 or float32).
      w: ``[E, N, K]`` expert weights, HF ``[out, in]`` orientation (bfloat16 or float32).
      group_sizes: ``[E]`` int32 rows per expert (a device array); rows past their sum
        are padding and come back as zeros.
      preferred_element_type: output dtype; ``None`` is ``x``'s dtype (float32 keeps the
        float32 accumulator unrounded).
      block_m, block_n: tile sizes (powers of two >= 16); ``None`` picks them
        (:func:`default_tiles`).
      num_warps, num_stages: Triton launch parameters (ignored by the interpreter);
        ``num_warps=None`` picks it with the tiles.
      interpret: ``None`` compiles on a GPU or inside ``compiled_kernels()`` and runs the
        Pallas interpreter elsewhere.

    Returns:
      ``[M, N]``, equal to ``jax.lax.ragged_dot(x, w.transpose(0, 2, 1), group_sizes)``.
    """
    if jnp.issubdtype(w.dtype, jnp.integer):
        raise ValueError("integer weights go through grouped_int8_matmul (with scales)")
    out_dtype = jnp.dtype(preferred_element_type or x.dtype)
    return _grouped_matmul(
        x, w, None, group_sizes, out_dtype=out_dtype, block_m=block_m, block_n=block_n,
        num_warps=num_warps, num_stages=num_stages, interpret=_resolve(interpret),
    )  # fmt: skip


def grouped_int8_matmul(
    x: jax.Array,
    q: jax.Array,
    scale: jax.Array,
    group_sizes: jax.Array,
    *,
    preferred_element_type: Any = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 3,
    interpret: bool | None = None,
) -> jax.Array:
    """:func:`grouped_matmul` with per-channel int8 expert weights ``q [E, N, K]`` and
    float32 scales ``scale [E, N]`` (weight ``q * scale[..., None]``, kvpage's ``int8``
    format per expert): int8 tiles are converted to ``x``'s dtype in registers and the
    scale multiplies each finished tile, as in ``int8_matmul.py``."""
    if q.dtype != jnp.int8:
        raise ValueError(f"expected int8 weights, got {q.dtype}")
    out_dtype = jnp.dtype(preferred_element_type or x.dtype)
    return _grouped_matmul(
        x, q, scale, group_sizes, out_dtype=out_dtype, block_m=block_m, block_n=block_n,
        num_warps=num_warps, num_stages=num_stages, interpret=_resolve(interpret),
    )  # fmt: skip
