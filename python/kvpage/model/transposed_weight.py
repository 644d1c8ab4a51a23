"""A linear weight kept in a training codebase's own layout: the layout hook.

Owns :class:`TransposedWeight`. kvpage's params tree (:mod:`kvpage.model.params`) holds
linear weights as Hugging Face's ``[out, in]`` matrices. JAX/Flax training code keeps
them the other way round, as a *kernel* ``[in..., out...]`` whose input and output
dimensions may each be split over several axes: tunix's Llama stores ``q_proj`` as
``[hidden, heads, head_dim]`` and ``o_proj`` as ``[heads, head_dim, hidden]``; Flax's
``nnx.Linear`` stores ``[in, out]``. Wrapping such an array in a
:class:`TransposedWeight` lets the engine multiply by it as it is: the array is the
node's only child (so ``update_params`` swaps the trainer's very buffer in, no copy and
no transpose per sync), and inside a step the merge of its axes to ``[in, out]`` is a
row-major bitcast that XLA does not copy; the product contracts the kernel's first
axis (:func:`kvpage.model.linear_kernels.matmul_nt`).

``shape`` is the logical ``(out, in)``, as for a plain or quantized weight, so shape
checks, hidden sizes and dtypes read the same for all three.

Two options cover kernels whose input axes do not lead (tunix's Gemma modules):
``index`` picks one entry of a leading stacking axis (``kv_einsum.w [2, kv_heads,
hidden, head_dim]``: keys are index 0, values index 1; both views hold the one array),
and ``in_start`` says where the input axes begin (``q_einsum.w [heads, hidden,
head_dim]``: ``in_start=1``); the axes before and after them are the output axes, in
order. Those kernels are not a row-major merge away from ``[in, out]``: inside a step
the product moves the input axes first (XLA may fold that into the dot or transpose the
kernel in the step), but the trainer's array is still held as it is, never copied.

Invariant: with ``dims`` the kernel's shape (less the leading axis when ``index`` is
set), ``prod(dims[in_start:in_start + in_axes]) == in`` and the product of the other
axes is ``out``; checked at construction whenever the kernel has a shape. The default
(``in_start=0``, ``index=None``) is the plain ``[in..., out...]`` kernel.

Cost: the host small-batch matmul kernel reads ``[out, in]`` rows, so products of a
transposed weight always run on XLA's dot (benches/RESULTS.md, "RL rollouts").
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp


@jax.tree_util.register_pytree_node_class
class TransposedWeight:
    """An ``[out, in]`` weight stored as a kernel ``[in..., out...]`` (``in_axes``
    leading axes of input), or more generally ``[out_a..., in..., out_b...]`` with the
    input axes from ``in_start`` on, optionally entry ``index`` of a stacked kernel."""

    __slots__ = ("kernel", "in_axes", "in_start", "index")

    def __init__(
        self, kernel: Any, in_axes: int = 1, *, in_start: int = 0, index: int | None = None
    ) -> None:
        if in_axes < 1:
            raise ValueError(f"in_axes must be >= 1, got {in_axes}")
        if in_start < 0:
            raise ValueError(f"in_start must be >= 0, got {in_start}")
        self.kernel = kernel
        self.in_axes = int(in_axes)
        self.in_start = int(in_start)
        self.index = None if index is None else int(index)
        shape = getattr(kernel, "shape", None)
        if shape is None:
            return
        dims = tuple(shape)
        if self.index is not None:
            if not dims or not 0 <= self.index < dims[0]:
                raise ValueError(f"index {index} is not an entry of a kernel of shape {dims}")
            dims = dims[1:]
        if len(dims) < self.in_start + self.in_axes or len(dims) <= self.in_axes:
            raise ValueError(
                f"a kernel of shape {tuple(shape)} has no output axes besides {in_axes} "
                f"input axes from axis {in_start}"
                + ("" if self.index is None else f" of entry {index}")
            )

    def _dims(self) -> tuple[int, ...]:
        dims = tuple(self.kernel.shape)
        return dims[1:] if self.index is not None else dims

    @property
    def plain(self) -> bool:
        """Whether the kernel is ``[in..., out...]`` (a row-major merge from ``[in,
        out]``; what code that rebuilds the node from ``(kernel, in_axes)`` assumes)."""
        return self.in_start == 0 and self.index is None

    @property
    def shape(self) -> tuple[int, int]:
        """The logical ``(out, in)`` of the weight."""
        dims = self._dims()
        lo, hi = self.in_start, self.in_start + self.in_axes
        return math.prod(dims[:lo] + dims[hi:]), math.prod(dims[lo:hi])

    @property
    def ndim(self) -> int:
        return 2

    @property
    def dtype(self) -> Any:
        return self.kernel.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the weight (an ``index`` view counts its entry only)."""
        total = int(self.kernel.nbytes)
        return total if self.index is None else total // int(self.kernel.shape[0])

    def as_in_out(self) -> jax.Array:
        """The kernel as ``[in, out]`` (a bitcast inside a traced step for a plain
        kernel; a slice and a transpose otherwise)."""
        out, inner = self.shape
        kernel = self.kernel
        if self.index is not None:
            kernel = jax.lax.index_in_dim(kernel, self.index, 0, keepdims=False)
        if self.in_start:
            lo, hi = self.in_start, self.in_start + self.in_axes
            rest = [a for a in range(kernel.ndim) if not lo <= a < hi]
            kernel = jnp.transpose(kernel, (*range(lo, hi), *rest))
        return jnp.reshape(kernel, (inner, out))

    def with_kernel(self, kernel: Any) -> TransposedWeight:
        """The same layout over another kernel (a cast or placed copy, a sharding spec)."""
        return type(self)(kernel, self.in_axes, in_start=self.in_start, index=self.index)

    # ---- pytree
    def tree_flatten(self) -> tuple[tuple[Any], tuple[int, int, int | None]]:
        return (self.kernel,), (self.in_axes, self.in_start, self.index)

    @classmethod
    def tree_unflatten(
        cls, aux: tuple[int, int, int | None], children: tuple[Any, ...]
    ) -> TransposedWeight:
        node = cls.__new__(cls)
        node.kernel = children[0]
        node.in_axes, node.in_start, node.index = aux
        return node

    def __repr__(self) -> str:
        shape = tuple(getattr(self.kernel, "shape", ()))
        extra = (f", in_start={self.in_start}" if self.in_start else "") + (
            "" if self.index is None else f", index={self.index}"
        )
        return f"TransposedWeight(kernel{shape}, in_axes={self.in_axes}{extra})"


def is_transposed(leaf: Any) -> bool:
    """Whether a params-tree node is a :class:`TransposedWeight`."""
    return isinstance(leaf, TransposedWeight)
