"""Speculative decoding settings, with vLLM's ``--speculative-config`` names.

This file owns :class:`SpeculativeConfig` and :func:`parse_speculative_config`, which
accepts what a user passes (a dict, its JSON text, a config, or None) and names the
problem in a ``ValueError``. The engine hands the result to the Rust scheduler, which
drafts and verifies (``rust/sched/scheduler/speculation.rs``); the device side is
:mod:`kvpage.sampling.verification`.

Methods: ``"ngram"`` (prompt lookup: the tokens that followed the latest earlier match of
the sequence's last ``prompt_lookup_min..prompt_lookup_max`` tokens), and ``"suffix"``
(the same lookup over recent sequences' prompts and outputs too, its own included:
GRPO's samples of one prompt, repeated tool output), and ``"draft_model"`` (a smaller model
sharing the target's tokenizer, named by ``"model"``, drafts greedily:
:mod:`kvpage.engine.draft_model`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpage.engine.json_config import config_dict

METHODS = ("ngram", "suffix", "draft_model")
PLANNED_METHODS = ("eagle", "eagle3", "medusa", "mtp")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """How sequences draft tokens for one-pass verification (module docs)."""

    method: str = "ngram"
    model: str | None = None
    """``"draft_model"``: the draft model (an HF directory or a .gguf file, as the target's
    ``model``)."""
    num_speculative_tokens: int = 15
    """Most drafted tokens per sequence and step (each sequence adapts its own count:
    ``docs/speculative.md``). 15, not vLLM's usual 5: on a CPU a verification of 16 tokens
    costs ~1.6x one of 6 (Qwen2.5-Coder-0.5B: 70 vs 45 ms), and code edits keep 14 tokens
    a verification (``kvpage bench spec``, 2026-11-28, ``benches/RESULTS.md``)."""
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    max_running: int = 8
    """Sequences draft only while at most this many run and nobody waits: a larger batch
    already fills the step, so drafts would cost more than they save."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            later = " (not supported yet)" if self.method in PLANNED_METHODS else ""
            raise ValueError(
                f"speculative_config method {self.method!r}{later}: supported methods are "
                f"{list(METHODS)}"
            )
        for name, value, top in (
            ("num_speculative_tokens", self.num_speculative_tokens, 64),
            ("prompt_lookup_max", self.prompt_lookup_max, 64),
            ("prompt_lookup_min", self.prompt_lookup_min, 64),
            ("max_running", self.max_running, 1 << 20),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top:
                raise ValueError(
                    f"speculative_config {name} must be an integer in [1, {top}], got {value!r}"
                )
        if self.method == "draft_model" and not (isinstance(self.model, str) and self.model):
            raise ValueError('speculative_config method "draft_model" needs "model": the draft '
                             "model's HF directory or .gguf file")
        if self.method != "draft_model" and self.model is not None:
            raise ValueError(f'speculative_config "model" is for method "draft_model", not '
                             f"{self.method!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) exceeds "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )

    def scheduler_args(self) -> dict[str, int]:
        """The Rust ``Scheduler``'s keyword arguments for these settings."""
        return {
            "speculative_method": self.method,
            "num_speculative_tokens": self.num_speculative_tokens,
            "prompt_lookup_min": self.prompt_lookup_min,
            "prompt_lookup_max": self.prompt_lookup_max,
            "speculative_max_running": self.max_running,
        }


def parse_speculative_config(value: Any) -> SpeculativeConfig | None:
    """``value`` (None, a :class:`SpeculativeConfig`, a dict or its JSON text) as a
    config; ValueError naming what is wrong."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    value = config_dict(value, "speculative_config", set(SpeculativeConfig.__dataclass_fields__))
    if "method" not in value:
        raise ValueError("speculative_config needs a method, e.g. {\"method\": \"ngram\"}")
    return SpeculativeConfig(**value)
