"""Choice of the paged-attention implementation (one string, one place).

This file owns the indirection between the decoder and ``kvpage.kernels``. Every backend
follows the contract of ``python/kvpage/kernels/xla/reference.py``: ``attend(q, k_pages, v_pages,
kv_lens, block_tables, cu_q_lens, num_seqs, *, sm_scale, decode_only, sliding_window=None,
logit_soft_cap=None, sinks=None)`` and ``write_kv(k_pages, v_pages, k, v, slot_mapping)``.
``sliding_window`` (int, static), ``logit_soft_cap`` (float, static) and ``sinks``
(float32 ``[num_q_heads]``) are the contract's options (sliding-window attention,
Gemma 2 soft-capping, gpt-oss sinks); every backend takes them, ``None`` is off.

``attention_backend`` is passed to ``kvpage.kernels.paged_attention``'s dispatcher:
``"reference"`` (the pure-jnp contract, for tests: its work follows the padded
table width), ``"xla"`` (plain XLA, work following the live KV), ``"pallas"`` (the
Pallas kernels), or ``None`` (the dispatcher's default: Pallas on GPU, ``"xla"``
elsewhere). ``decode_only=True``
is the caller's promise that every live row has exactly one query token; backends with a
decode-specialised kernel use it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

AttendFn = Callable[..., jax.Array]
WriteKVFn = Callable[
    [jax.Array, jax.Array, jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array]
]


class AttentionBackend(NamedTuple):
    """The two kernels the decoder calls per layer, and the resolved backend name.

    ``decode_specialized``: whether ``attend(..., decode_only=True)`` runs a different
    kernel (so a runner should compile pure-decode steps separately).
    """

    name: str
    attend: AttendFn
    write_kv: WriteKVFn
    decode_specialized: bool


def _reference_attend(
    *args: Any,
    sm_scale: float,
    decode_only: bool = False,
    sliding_window: int | None = None,
    logit_soft_cap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    from kvpage import kernels

    return kernels.ragged_paged_attention_reference(
        *args,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        logit_soft_cap=logit_soft_cap,
        sinks=sinks,
    )


def get_attention_backend(name: str | None = None) -> AttentionBackend:
    """Resolve ``attention_backend`` to callables; ValueError for an unknown name."""
    from kvpage import kernels

    resolved = kernels.resolve_backend(name)
    if resolved == "reference":
        return AttentionBackend("reference", _reference_attend, kernels.write_kv_pages, False)
    # Only the Pallas backend has a separate decode kernel worth its own executables;
    # the xla backend's prefill loop simply runs zero times in a decode-only step.
    return AttentionBackend(
        resolved,
        functools.partial(kernels.paged_attention, backend=resolved),
        kernels.write_kv_pages,
        resolved == "pallas",
    )
