"""Drafts from a smaller model (speculative method ``"draft_model"``).

This file owns :class:`DraftModelProposer`. Before each step of the target engine it asks
the Rust scheduler which samples will draft (``Scheduler.draft_requests``: speculation
applies, the sample decodes, its draft length adapted to its acceptance), runs the draft
model greedily for that many tokens after each sample's text, and hands the tokens back
(``Scheduler.propose_drafts``). The target then verifies them in one pass as it verifies
n-gram drafts (``rust/sched/scheduler/speculation.rs``): a greedy draft is deterministic,
so keeping a drafted token exactly when the target samples it leaves every output's
distribution, and greedy outputs token for token, as they are without speculation.

The draft model runs in its own :class:`~kvpage.engine.llm_engine.LLMEngine`, with its own
paged KV pool and prefix cache: each sample's drafting is a request whose prompt is the
sample's tokens so far, so the blocks computed at earlier steps (drafts the target kept
included) come from the draft engine's prefix cache, and only the tail since then is
computed. Every block returns to the draft pool when its request ends. The draft model
must share the target's tokenizer (the same vocabulary size is checked at load).

A failed draft step costs drafts, never requests: the error is logged once and that step
runs without drafts.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from kvpage.sampling.params import SamplingParams

if TYPE_CHECKING:
    from kvpage._core import Scheduler
    from kvpage.engine.config import EngineConfig
    from kvpage.model.config import ModelConfig
    from kvpage.outputs import RequestOutput

log = logging.getLogger(__name__)


class DraftEngine(Protocol):
    """What the proposer uses of the draft model's ``LLMEngine``."""

    model_config: ModelConfig

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams) -> Any: ...
    def step(self) -> list[RequestOutput]: ...
    def has_unfinished_requests(self) -> bool: ...
    def request_ids(self) -> list[str]: ...
    def abort_request(self, request_ids: str) -> Any: ...


def draft_engine_config(target: EngineConfig, max_model_len: int) -> EngineConfig:
    """The draft engine's settings: the target's, for the draft model, with a seat per
    sequence that may draft, the target's context length, and nothing it does not need."""
    spec = target.speculative_config
    assert spec is not None and spec.model is not None
    return dataclasses.replace(
        target,
        model=spec.model,
        max_num_seqs=spec.max_running,
        max_model_len=max_model_len,
        num_gpu_blocks=None,
        kv_cache_memory=None,
        speculative_config=None,
        kv_events_config=None,
        enable_lora=False,
        overlap_host_work=False,
        enable_prefix_caching=True,
        tensor_parallel_size=1,
    )


class DraftModelProposer:
    """Runs a draft model's engine for the target engine's drafting samples (module
    docs). ``engine`` is built from :func:`draft_engine_config`."""

    def __init__(self, engine: DraftEngine, target_model: ModelConfig, name: str) -> None:
        self.engine = engine
        draft_vocab = engine.model_config.vocab_size
        if draft_vocab != target_model.vocab_size:
            raise ValueError(
                f"speculative_config model {name!r} has a vocabulary of {draft_vocab} "
                f"tokens, the target's has {target_model.vocab_size}: a draft model must "
                "share the target's tokenizer"
            )
        self._serial = 0
        self._failed = False

    def propose(self, scheduler: Scheduler) -> int:
        """Draft for every sample ``scheduler`` will let draft at its next ``schedule()``;
        returns the number of samples given drafts."""
        wanted = scheduler.draft_requests()
        if not wanted:
            return 0
        try:
            drafts = self._run(scheduler, wanted)
        except Exception:  # drafts are an optimisation: the step runs without them
            if not self._failed:
                log.exception("the draft model failed; steps run without its drafts")
                self._failed = True
            for request_id in self.engine.request_ids():
                self.engine.abort_request(request_id)
            return 0
        for (handle, sample_index), tokens in drafts.items():
            scheduler.propose_drafts(handle, sample_index, tokens)
        return len(drafts)

    def _run(self, scheduler: Scheduler, wanted: list[tuple[int, int, int]]
             ) -> dict[tuple[int, int], np.ndarray]:
        engine = self.engine
        samples: dict[str, tuple[int, int]] = {}
        for handle, sample_index, max_tokens in wanted:
            tokens = scheduler.sample_tokens(handle, sample_index)
            if tokens is None:
                continue
            self._serial += 1
            request_id = f"draft-{self._serial}"
            engine.add_request(
                request_id, {"prompt_token_ids": tokens.tolist()},
                SamplingParams(max_tokens=max_tokens, temperature=0.0),
            )
            samples[request_id] = (handle, sample_index)
        drafts: dict[tuple[int, int], np.ndarray] = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished and output.request_id in samples:
                    token_ids = output.outputs[0].token_ids if output.outputs else []
                    if token_ids:
                        drafts[samples[output.request_id]] = np.asarray(token_ids, np.int32)
        return drafts
