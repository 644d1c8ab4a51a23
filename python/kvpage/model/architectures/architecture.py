"""What an architecture file declares: how its checkpoints spell a model kvpage knows.

This file owns :class:`Architecture` (the declarative description one file of
:mod:`kvpage.model.architectures` gives) and :class:`TensorSource` (where one tensor of
kvpage's parameter layout comes from in a checkpoint). An architecture does not contain
a forward pass: the decoder (:mod:`kvpage.model.decoder`) is assembled from shared blocks
by the fields of :class:`~kvpage.model.config.ModelConfig` that :attr:`Architecture.parse`
sets (norm offset, sandwich norms, activation, MoE, layer kinds, soft-caps...).

Names. kvpage's parameter layout (:mod:`kvpage.model.params`) uses the Llama / Qwen3-MoE
HF names; a checkpoint that spells a tensor differently maps it with :attr:`renames`
(regex substitutions applied to kvpage's name, e.g. Mixtral's ``block_sparse_moe``) and
:attr:`fused` (a row range of one fused checkpoint tensor, e.g. Phi-3's ``qkv_proj``).
Experts are one stacked tensor ``[num_experts, out, in]`` in kvpage's layout and one
tensor per expert in HF checkpoints (``...experts.{e}.gate_proj.weight``): the source
of a stacked name lists the per-expert names.

GGUF. :attr:`gguf_names` are the ``general.architecture`` values llama.cpp writes for
this architecture; :attr:`gguf_qk_permuted` says its converter interleaved the q/k rows
(Llama); :attr:`gguf_tensors` adds or overrides GGUF tensor stems, :attr:`gguf_fused`
splits fused ones (Phi-3's ``attn_qkv``); :attr:`gguf_parse` reads the architecture's own
metadata keys. llama.cpp's converter stores norm weights with the model's norm offset
added (Gemma's ``1 + weight``); the GGUF loader subtracts it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

ConfigFields = dict[str, Any]
"""ModelConfig keyword arguments (all but ``architecture``)."""

_EXPERTS = re.compile(r"^(.*\.experts)\.(\w+\.\w+)$")


def available_source(source: TensorSource, present: Callable[[str], bool]) -> TensorSource:
    """The first of ``source`` and its ``otherwise`` chain whose tensors are all
    ``present`` (``source`` itself when none is: its names are the ones to report)."""
    option: TensorSource | None = source
    while option is not None:
        if all(present(name) for name in option.names):
            return option
        option = option.otherwise
    return source


class TensorSource(NamedTuple):
    """Where one kvpage tensor comes from: checkpoint ``names``, and how they combine.

    * one name, ``rows`` None: the tensor itself;
    * one name, ``rows=(start, stop)``: that row range of a fused tensor;
    * several names (``stacked``): one per expert, stacked on a new leading axis.
    """

    names: tuple[str, ...]
    rows: tuple[int, int] | None = None
    stacked: bool = False
    transform: Callable[[np.ndarray], np.ndarray] | None = None
    """Applied last: a layout change (gpt-oss's ``[E, in, out]`` experts)."""
    combine: Callable[..., np.ndarray] | None = None
    """Builds the tensor from all of ``names`` (MXFP4 blocks and scales)."""
    otherwise: TensorSource | None = None
    """Where to read instead when a checkpoint lacks ``names`` (another storage)."""

    def read(self, get: Callable[[str], Any]) -> np.ndarray:
        if self.combine is not None:
            value = self.combine(*(np.asarray(get(name)) for name in self.names))
        elif self.stacked:
            value = np.stack([np.asarray(get(name)) for name in self.names])
        else:
            value = np.asarray(get(self.names[0]))
        if self.rows is not None:
            value = value[self.rows[0]:self.rows[1]]
        if self.transform is not None:
            value = np.ascontiguousarray(self.transform(value))
        return value


GGUFGet = Callable[[str, Any], Any]
FusedRows = Callable[[Any], tuple[int, int]]
"""``config -> (start, stop)`` rows of the fused tensor that hold one kvpage tensor."""


@dataclass(frozen=True)
class Architecture:
    """One HF architecture: its names, config parsing and checkpoint spelling."""

    name: str
    """The ``architectures`` entry of an HF ``config.json`` (e.g. ``Gemma2ForCausalLM``)."""
    model_type: str
    parse: Callable[[Mapping[str, Any]], ConfigFields]
    """``config.json`` contents -> ModelConfig keyword arguments."""
    renames: tuple[tuple[str, str], ...] = ()
    """``(pattern, replacement)`` regex substitutions, kvpage name -> checkpoint name."""
    fused: Mapping[str, tuple[str, FusedRows]] = field(default_factory=dict)
    """Layer-relative kvpage name -> (fused checkpoint name, rows of it)."""
    gguf_names: tuple[str, ...] = ()
    gguf_qk_permuted: bool = False
    gguf_tensors: Mapping[str, str] = field(default_factory=dict)
    """Extra GGUF layer tensor stems -> kvpage layer-relative names."""
    gguf_fused: Mapping[str, tuple[tuple[str, FusedRows], ...]] = field(default_factory=dict)
    """GGUF layer tensor stem -> the kvpage layer-relative names its row ranges hold."""
    gguf_experts: bool = False
    """Whether this is the experts-carrying variant of a shared ``general.architecture``
    (Mixtral files say ``llama``)."""
    gguf_parse: Callable[[GGUFGet, ConfigFields], ConfigFields] | None = None
    """``(get, fields parsed so far) -> fields to add``; ``get(key suffix, default)``
    reads the ``{general.architecture}.{suffix}`` metadata value."""
    sources: Mapping[str, Callable[[Any], TensorSource]] = field(default_factory=dict)
    """Layer-relative kvpage name -> its source, for layouts the other fields cannot
    say (gpt-oss's fused, interleaved, transposed experts); consulted first."""

    def checkpoint_name(self, name: str) -> str:
        """The checkpoint's spelling of the (unstacked) kvpage tensor ``name``."""
        for pattern, replacement in self.renames:
            name = re.sub(pattern, replacement, name)
        return name

    def source(self, name: str, config: Any) -> TensorSource:
        """Where kvpage's tensor ``name`` (a :func:`~kvpage.model.params.param_spec`
        name) comes from in an HF checkpoint of this architecture."""
        layer = re.match(r"^(model\.layers\.\d+\.)(.*)$", name)
        if layer is not None and layer.group(2) in self.sources:
            return _prefixed(self.sources[layer.group(2)](config), layer.group(1))
        match = _EXPERTS.match(name)
        if match is not None and config.moe is not None:
            prefix, rest = match.groups()
            names = tuple(
                self.checkpoint_name(f"{prefix}.{e}.{rest}")
                for e in range(config.moe.num_experts)
            )
            return TensorSource(names, stacked=True)
        if layer is not None and layer.group(2) in self.fused:
            fused_name, rows = self.fused[layer.group(2)]
            return TensorSource((self.checkpoint_name(layer.group(1) + fused_name),),
                                rows=rows(config))
        return TensorSource((self.checkpoint_name(name),))


def _prefixed(source: TensorSource, prefix: str) -> TensorSource:
    """``source`` (and its ``otherwise`` chain) with layer-relative names made whole."""
    otherwise = None if source.otherwise is None else _prefixed(source.otherwise, prefix)
    return source._replace(names=tuple(prefix + n for n in source.names), otherwise=otherwise)
