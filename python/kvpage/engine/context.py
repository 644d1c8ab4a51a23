"""What every stage of the engine reads: one :class:`EngineContext` per ``LLMEngine``.

The stages (intake, plan reading, outputs, scoring, failures, ...) each own their own
state and share only this: the settings, the model, the scheduler, the runner, the
tokenizer, the counters and the weights' version. ``LLMEngine`` hands its attributes of
the same names through to it, so that replacing one (a test's spy scheduler, another
tokenizer) reaches every stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpage._core import Scheduler
    from kvpage.engine.config import EngineConfig
    from kvpage.model.config import ModelConfig
    from kvpage.runner.protocol import StepRunner


def _counters() -> dict[str, int | float]:
    return {
        "prompt_tokens": 0,
        "generation_tokens": 0,
        "steps": 0,
        "structured_mask_rows": 0,
        "structured_mask_steps": 0,
        "structured_mask_hidden_steps": 0,
        "structured_mask_s": 0.0,
    }


@dataclass(slots=True, eq=False)
class EngineContext:
    config: EngineConfig
    model_config: ModelConfig
    max_model_len: int
    """``config.max_model_len`` resolved against the model."""
    eos_token_ids: list[int]
    """The model's, its generation config's and its tokenizer's end-of-sequence ids."""
    runner: StepRunner
    scheduler: Scheduler
    tokenizer: Any
    """A Hugging Face tokenizer (or one of the same interface), or None: token ids only."""
    counters: dict[str, int | float] = field(default_factory=_counters)
    """``LLMEngine.counters``: running totals (``failed_steps`` and ``multi_step_calls``
    appear once they happen)."""
    params_version: int = 0
    """Bumped by each ``update_params``; every token carries the version it came from."""
