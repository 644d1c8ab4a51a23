"""Backend selection for paged attention.

Owns :func:`paged_attention`, the one entry point model code calls. It picks
between the pure-jnp reference (``reference.py``) and the Pallas kernels
(``ragged_paged_attention.py``, ``paged_decode_attention.py``):

* ``backend="reference"``: the jnp reference (the contract; its work follows the
  padded table width, so it is for tests), on any platform.
* ``backend="xla"``: flash attention in plain XLA with live-length loops
  (``xla_paged_attention.py``); the default off-GPU.
* ``backend="pallas"``: the Pallas kernels; compiled through Triton on GPU,
  run by the Pallas interpreter (``interpret=True``) anywhere else, which is
  exact but slow - meant for tests.
* ``backend=None``: the Pallas kernels on GPU, ``"xla"`` elsewhere.

``decode_only=True`` is the caller's promise that every live row has
``q_len == 1``; with the Pallas backend it routes to the split-K decode
kernel. Other Pallas steps run :func:`mixed_paged_attention`: the ragged
kernel for rows with ``q_len > 1`` and the split-K decode kernel for the
decode rows, so decode rows keep split-K in steps with prefill. Tuning
knobs are not exposed here on purpose: the kernels' defaults are what model
code gets.

``sliding_window``, ``logit_soft_cap`` (static) and ``sinks`` (an ``[Hq]`` float32
array) are the contract's options (``reference.py``); every backend takes them, and
``None`` (the default) leaves each backend's program as it was without them.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax
import jax.numpy as jnp

from kvpage.kernels.pallas._compat import on_gpu
from kvpage.kernels.pallas.paged_decode_attention import paged_decode_attention
from kvpage.kernels.pallas.ragged_paged_attention import ragged_paged_attention
from kvpage.kernels.xla.reference import ragged_paged_attention_reference
from kvpage.kernels.xla.xla_paged_attention import xla_paged_attention

BACKENDS = ("reference", "xla", "pallas")

_COMPILED = contextvars.ContextVar("kvpage_pallas_compiled", default=False)


@contextlib.contextmanager
def compiled_kernels() -> Iterator[None]:
    """Trace the Pallas kernels for Triton (``interpret=False``) even off-GPU.

    For lowering/exporting a GPU program on a CPU machine (``jax.export`` with
    ``platforms=["cuda"]``): inside this block the Pallas backend never falls
    back to the interpreter. Running such a trace on CPU fails; lowering works.
    """
    token = _COMPILED.set(True)
    try:
        yield
    finally:
        _COMPILED.reset(token)


def interpret_default() -> bool:
    """Whether the Pallas backend runs the interpreter here (off-GPU, unless forced)."""
    return not (_COMPILED.get() or on_gpu())


def resolve_backend(backend: str | None) -> str:
    """Concrete backend name for ``backend`` on this platform."""
    if backend is None:
        return "pallas" if on_gpu() else "xla"
    if backend not in BACKENDS:
        raise ValueError(
            f"unknown paged-attention backend {backend!r}; "
            f"expected one of {', '.join(repr(b) for b in BACKENDS)} or None"
        )
    return backend


def paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    backend: str | None = None,
    decode_only: bool = False,
    sliding_window: int | None = None,
    logit_soft_cap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Ragged paged attention (contract: ``reference.py``) on the chosen backend."""
    args = (q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs)
    resolved = resolve_backend(backend)
    options = _options(sliding_window, logit_soft_cap, sinks)
    if resolved == "reference":
        return ragged_paged_attention_reference(*args, sm_scale=sm_scale, **options)
    if resolved == "xla":
        return xla_paged_attention(*args, sm_scale=sm_scale, decode_only=decode_only, **options)
    interpret = interpret_default()
    if decode_only:
        return paged_decode_attention(*args, sm_scale=sm_scale, interpret=interpret, **options)
    return mixed_paged_attention(*args, sm_scale=sm_scale, interpret=interpret, **options)


def _options(
    sliding_window: int | None, logit_soft_cap: float | None, sinks: jax.Array | None
) -> dict[str, object]:
    """The options that are set, as keyword arguments (none: a kernel call as before)."""
    options = {
        "sliding_window": sliding_window,
        "logit_soft_cap": logit_soft_cap,
        "sinks": sinks,
    }
    return {name: value for name, value in options.items() if value is not None}


def mixed_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    interpret: bool = False,
    sliding_window: int | None = None,
    logit_soft_cap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """A step with prefill rows: decode rows still get split-K.

    Rows with ``q_len > 1`` go through the ragged kernel, which skips the decode
    rows (``q_len == 1``); the decode rows go through the split-K decode kernel,
    which sees the other rows as empty (``kv_len`` 0). Each kernel leaves the
    other's tokens at 0, so the two outputs add up to the contract's result.
    """
    num_rows = block_tables.shape[0]
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    live = jnp.arange(num_rows, dtype=jnp.int32) < num_seqs[0]
    decode_row = live & (q_lens == 1)
    options = _options(sliding_window, logit_soft_cap, sinks)
    prefill = ragged_paged_attention(
        q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, decode_row,
        sm_scale=sm_scale, interpret=interpret, **options,
    )  # fmt: skip
    decode = paged_decode_attention(
        q, k_pages, v_pages, jnp.where(decode_row, kv_lens, 0), block_tables, cu_q_lens,
        num_seqs, sm_scale=sm_scale, interpret=interpret, **options,
    )  # fmt: skip
    return prefill + decode
