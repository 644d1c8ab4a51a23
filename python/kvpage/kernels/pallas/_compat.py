"""Version shims and small helpers shared by the Pallas kernels.

Owns everything that differs between the jax releases the kernels must run
on (0.10 here, 0.11/0.12 on the GPU machines), so the kernel files can be
written against one spelling:

* masked loads/stores: newer jax spells them ``plgpu.load(ref.at[idx], ...)``
  (``jax.experimental.pallas.triton``); older releases had
  ``pl.load(ref, idx, ...)``. :func:`masked_load` / :func:`masked_store`
  pick whichever exists.
* Triton compiler params: ``plgpu.CompilerParams`` (new) or
  ``plgpu.TritonCompilerParams`` (old).
* the "squeezed" block dimension marker: ``pl.squeezed`` (new) or ``None``.

It also holds the platform test used to decide between compiled Triton and
``interpret=True`` and a power-of-two helper (Triton tensors must have
power-of-two sizes).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

Slice: Any = type(pl.ds(0, 1))  # Pallas' slice object (pl.ds / pl.dslice)

try:  # The Triton-specific Pallas API; importable on CPU-only installs too.
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover - very old jax
    plgpu = None  # type: ignore[assignment]

SQUEEZED: Any = getattr(pl, "squeezed", None)

LOG2E = 1.4426950408889634  # log2(e): scores are kept in base 2 so exp2 is used.


def next_power_of_2(x: int) -> int:
    """Smallest power of two >= ``x`` (and >= 1)."""
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def is_power_of_2(x: int) -> bool:
    return x >= 1 and (x & (x - 1)) == 0


def check_dot_tile(*, rows: int, block_k: int) -> None:
    """Reject tiles that Triton's ``tl.dot`` cannot take (every dim must be >= 16).

    Enforced in interpret mode too, so CPU tests exercise GPU-valid configurations.
    """
    if rows < 16 or block_k < 16:
        raise ValueError(
            f"query tile rows ({rows}) and KV block ({block_k} tokens) must both be >= 16"
        )


def _index_dtype() -> Any:
    return jax.dtypes.canonicalize_dtype(jnp.int64)  # int32 unless x64 is enabled


def _canonical_index(idx: tuple[Any, ...]) -> tuple[Any, ...]:
    """Cast traced scalar indices (and slice starts) to the default int dtype.

    A no-op without x64. With x64 on, Python-int indices become int64 while
    ``program_id`` and friends stay int32, and the interpreter's store rule
    rejects mixed index dtypes.
    """
    want = _index_dtype()
    out = []
    for i in idx:
        if isinstance(i, jax.Array | np.ndarray | np.generic) and i.ndim == 0 and i.dtype != want:
            i = i.astype(want)
        elif isinstance(i, Slice) and isinstance(i.start, jax.Array) and i.start.dtype != want:
            i = pl.ds(i.start.astype(want), i.size)
        out.append(i)
    return tuple(out)


def masked_load(ref: Any, idx: tuple[Any, ...], *, mask: jax.Array, other: Any) -> jax.Array:
    """``ref[idx]`` where ``mask`` holds; ``other`` elsewhere (masked lanes touch no memory)."""
    idx = _canonical_index(idx)
    if plgpu is not None and hasattr(plgpu, "load"):
        return plgpu.load(ref.at[idx], mask=mask, other=other)
    return pl.load(ref, idx, mask=mask, other=other)  # type: ignore[attr-defined]


def masked_store(ref: Any, idx: tuple[Any, ...], val: jax.Array, *, mask: jax.Array) -> None:
    """``ref[idx] = val`` where ``mask`` holds."""
    idx = _canonical_index(idx)
    if plgpu is not None and hasattr(plgpu, "store"):
        plgpu.store(ref.at[idx], val, mask=mask)
    else:
        pl.store(ref, idx, val, mask=mask)  # type: ignore[attr-defined]


def triton_compiler_params(num_warps: int, num_stages: int) -> Any:
    """Triton launch parameters, under whichever class name this jax uses."""
    cls = getattr(plgpu, "CompilerParams", None) or getattr(plgpu, "TritonCompilerParams", None)
    if cls is None:  # pragma: no cover - very old jax
        return None
    return cls(num_warps=num_warps, num_stages=num_stages)


def on_gpu() -> bool:
    """True when the default backend can run the Triton-lowered kernels."""
    return jax.default_backend() in ("gpu", "cuda", "rocm")
