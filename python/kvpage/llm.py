"""The offline API: ``LLM(model=...).generate(prompts, sampling_params)``.

from kvpage import LLM, SamplingParams
llm = LLM(model="path/to/hf-dir", max_num_seqs=64)
outputs = llm.generate(["Hello", "The sky is"], SamplingParams(temperature=0))
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvpage.engine.config import EngineConfig
from kvpage.engine.intake import PromptType
from kvpage.engine.llm_engine import LLMEngine
from kvpage.lora.request import LoRARequest
from kvpage.model.config import ModelConfig
from kvpage.outputs import RequestOutput
from kvpage.outputs.rollout import (
    SCORE_PARAMS,
    RolloutBatch,
    build_rollout_batch,
    rollout_sampling_params,
)
from kvpage.sampling.params import SamplingParams

Message = dict[str, str]


class LLM:
    """Generate for many prompts at once with continuous batching."""

    def __init__(
        self, model: str | None = None, *, tokenizer: Any = None, mesh: Any = None,
        **engine_args: Any,
    ):
        """``mesh``: run on this ``jax.sharding.Mesh`` (see :meth:`from_params`)."""
        self.engine = LLMEngine.from_config(EngineConfig(model=model, **engine_args), mesh)
        if tokenizer is not None:
            self.engine.tokenizer = tokenizer
        self._ids = itertools.count()

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        llm = cls.__new__(cls)
        llm.engine = engine
        llm._ids = itertools.count()
        return llm

    @classmethod
    def from_params(
        cls, config: ModelConfig, params: Any, tokenizer: Any = None, *, mesh: Any = None,
        **engine_args: Any,
    ) -> LLM:
        """Generate straight from a parameter pytree already in memory.

        ``params`` follows :mod:`kvpage.model.params` (e.g. a JAX training run's
        pytree). Leaves that already are device arrays in the engine's layout (one
        device, or :func:`kvpage.runner.tensor_parallel.shard_params` for ``tensor_parallel_size``
        > 1) are used as they are, without a copy; others are moved there once.

        ``mesh``: a trainer's ``jax.sharding.Mesh`` with a ``"tp"`` axis, used as it
        is: weights, KV heads and vocab split over ``"tp"`` (replicated over the mesh's
        other axes), so leaves the trainer already holds sharded that way are not
        moved. It replaces ``tensor_parallel_size``."""
        engine = LLMEngine(EngineConfig(**engine_args), config, params, tokenizer, mesh=mesh)
        return cls.from_engine(engine)

    def update_params(self, params: Any) -> int:
        """Generate with new weights from the next step on (see
        ``LLMEngine.update_params``); returns the new params version."""
        return self.engine.update_params(params)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix (see ``LLMEngine.reset_prefix_cache``)."""
        return self.engine.reset_prefix_cache()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order.

        A prompt is a string or ``{"prompt_token_ids": [...]}``;
        ``sampling_params`` is one for all prompts or one per prompt; ``lora_request``
        (with ``enable_lora``) one adapter for all, or one per prompt (None: the base
        model), mixed within the same steps.
        """
        prompts, params_list = _pair_params(prompts, sampling_params)
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        loras = _per_prompt_loras(lora_request, len(prompts))
        ids = []
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
                request_id = f"generate-{next(self._ids)}"
                self.engine.add_request(
                    request_id,
                    prompt,
                    params,
                    priority=priority[i] if priority else 0,
                    final_only=True,
                    lora_request=loras[i],
                )
                ids.append(request_id)
            return self._run(ids, use_tqdm)
        except BaseException:
            self.engine.abort_request(ids)
            raise

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them through the
        model's chat template."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer with a chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            tokenizer.apply_chat_template(
                list(conv),
                tokenize=False,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
            )
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def rollout(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        pad_id: int | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> RolloutBatch:
        """Sample like :meth:`generate` (one ``sampling_params`` or one per prompt),
        returning arrays for an RL loop: per sample (``n`` per prompt, rows in input
        order) the token ids without the stop token, each token's logprob in
        ``logprobs_mode`` and the lengths, as one :class:`~kvpage.outputs.rollout.RolloutBatch`.
        No Python object is made per token. Padding is ``pad_id`` (default: the
        tokenizer's pad token, else the first EOS id, else 0). ``lora_request``: as in
        :meth:`generate` (a LoRA policy)."""
        prompts, params_list = _pair_params(prompts, sampling_params)
        loras = _per_prompt_loras(lora_request, len(prompts))
        ids = []
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
                request_id = f"rollout-{next(self._ids)}"
                self.engine.add_request(
                    request_id, prompt, rollout_sampling_params(params), final_only=True,
                    logprobs_as_arrays=True, lora_request=loras[i],
                )
                ids.append(request_id)
            version = self.engine.params_version
            outputs = self._run(ids, use_tqdm)
        except BaseException:
            self.engine.abort_request(ids)
            raise
        return build_rollout_batch(outputs, self._pad_id() if pad_id is None else pad_id,
                                   version)

    def _pad_id(self) -> int:
        pad = getattr(self.engine.tokenizer, "pad_token_id", None)
        if pad is not None:
            return int(pad)
        return int(min(self.engine.eos_token_ids)) if self.engine.eos_token_ids else 0

    def score(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        completion_token_ids: Sequence[Sequence[int]],
        use_tqdm: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> list[np.ndarray]:
        """``log p(completion[j] | prompt + completion[:j])`` for every token of each
        ``(prompt, completion)`` pair: one float32 array per pair, from the raw logits
        of the current weights (a teacher-forced pass on the engine's compiled prefill).
        A prompt shared by several completions is computed once (with prefix caching
        on), and only completion positions are scored. ``lora_request``: score under
        that adapter."""
        if len(prompt_token_ids) != len(completion_token_ids):
            raise ValueError(
                f"score: got {len(prompt_token_ids)} prompts and "
                f"{len(completion_token_ids)} completions"
            )
        results: list[np.ndarray | None] = [None] * len(prompt_token_ids)
        ids, rows = [], []
        try:
            for i, (prompt, completion) in enumerate(
                zip(prompt_token_ids, completion_token_ids, strict=True)
            ):
                prompt, completion = list(map(int, prompt)), list(map(int, completion))
                if not prompt:
                    raise ValueError(f"score: prompt {i} is empty")
                if not completion:
                    results[i] = np.zeros(0, np.float32)
                    continue
                request_id = f"score-{next(self._ids)}"
                self.engine.add_request(
                    request_id, {"prompt_token_ids": prompt + completion}, SCORE_PARAMS,
                    final_only=True, score_from=len(prompt), lora_request=lora_request,
                )
                ids.append(request_id)
                rows.append(i)
            for i, out in zip(rows, self._run(ids, use_tqdm), strict=True):
                if out.error is not None or out.prompt_logprob_array is None:
                    raise RuntimeError(f"score: pair {i} failed: {out.error}")
                results[i] = out.prompt_logprob_array
        except BaseException:
            self.engine.abort_request(ids)
            raise
        return [r for r in results if r is not None]

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", unit="req", dynamic_ncols=True)
        wanted = set(ids)
        while wanted - finished.keys():
            for output in self.engine.step():
                if output.finished and output.request_id in wanted:
                    finished[output.request_id] = output
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [finished[i] for i in ids]


def _pair_params(
    prompts: PromptType | Sequence[PromptType],
    sampling_params: SamplingParams | Sequence[SamplingParams] | None,
) -> tuple[list[PromptType], list[SamplingParams]]:
    """The prompts as a list, each with its ``SamplingParams`` (one for all, or one per
    prompt: ValueError when the counts differ)."""
    if isinstance(prompts, str | dict):
        prompts = [prompts]
    prompts = list(prompts)
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return prompts, [sampling_params or SamplingParams()] * len(prompts)
    params_list = list(sampling_params)
    if len(params_list) != len(prompts):
        raise ValueError(f"got {len(params_list)} sampling_params for {len(prompts)} prompts")
    return prompts, params_list


def _per_prompt_loras(lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
                      count: int) -> Sequence[LoRARequest | None]:
    """One adapter (or None) per prompt, from one for all or a list."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    loras = list(lora_request)
    if len(loras) != count:
        raise ValueError(f"got {len(loras)} LoRA requests for {count} prompts")
    return loras
