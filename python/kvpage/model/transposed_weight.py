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

Invariant: ``prod(kernel.shape[:in_axes]) == in`` and ``prod(kernel.shape[in_axes:]) ==
out``; checked at construction whenever the kernel has a shape.

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
    leading axes of input)."""

    __slots__ = ("kernel", "in_axes")

    def __init__(self, kernel: Any, in_axes: int = 1) -> None:
        if in_axes < 1:
            raise ValueError(f"in_axes must be >= 1, got {in_axes}")
        self.kernel = kernel
        self.in_axes = int(in_axes)
        shape = getattr(kernel, "shape", None)
        if shape is not None and len(shape) <= self.in_axes:
            raise ValueError(
                f"a kernel of shape {tuple(shape)} has no output axes after {in_axes} "
                "input axes"
            )

    @property
    def shape(self) -> tuple[int, int]:
        """The logical ``(out, in)`` of the weight."""
        dims = tuple(self.kernel.shape)
        return math.prod(dims[self.in_axes :]), math.prod(dims[: self.in_axes])

    @property
    def ndim(self) -> int:
        return 2

    @property
    def dtype(self) -> Any:
        return self.kernel.dtype

    @property
    def nbytes(self) -> int:
        return int(self.kernel.nbytes)

    def as_in_out(self) -> jax.Array:
        """The kernel as ``[in, out]`` (a bitcast inside a traced step)."""
        out, inner = self.shape
        return jnp.reshape(self.kernel, (inner, out))

    # ---- pytree
    def tree_flatten(self) -> tuple[tuple[Any], int]:
        return (self.kernel,), self.in_axes

    @classmethod
    def tree_unflatten(cls, in_axes: int, children: tuple[Any, ...]) -> TransposedWeight:
        node = cls.__new__(cls)
        node.kernel = children[0]
        node.in_axes = in_axes
        return node

    def __repr__(self) -> str:
        shape = tuple(getattr(self.kernel, "shape", ()))
        return f"TransposedWeight(kernel{shape}, in_axes={self.in_axes})"


def is_transposed(leaf: Any) -> bool:
    """Whether a params-tree node is a :class:`TransposedWeight`."""
    return isinstance(leaf, TransposedWeight)
