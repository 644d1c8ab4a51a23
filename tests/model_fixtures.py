"""Shared helpers for the model / runner / sampler tests.

* puts ``python/`` and the repo root on ``sys.path`` and, when the Rust extension
  ``kvpage._core`` is not built in this checkout, makes ``kvpage.model`` / ``kvpage.runner``
  importable without running ``kvpage/__init__.py`` (they do not need the extension);
* builds tiny random HF transformers models and saves them as safetensors;
* :class:`PlainPlanner` plays the scheduler for plain sequences (no prefix sharing):
  block allocation, chunked prefill under a token budget mixed with decodes, and the
  construction of :class:`kvpage.runner.StepPlan` objects.
"""

from __future__ import annotations

import importlib
import math
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "python"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

_SOURCE_PKG = str(ROOT / "python" / "kvpage")
try:
    _pkg = importlib.import_module("kvpage")
except ImportError:  # kvpage._core not built: load the pure-Python subpackages only
    _pkg = types.ModuleType("kvpage")
    _pkg.__path__ = [_SOURCE_PKG]
    sys.modules["kvpage"] = _pkg
# An installed (non-editable) kvpage may already be imported: make the subpackages
# under test resolve from this checkout first.
if _SOURCE_PKG not in list(_pkg.__path__):
    _pkg.__path__.insert(0, _SOURCE_PKG)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from kvpage.model import (  # noqa: E402
    AttentionMetadata,
    ModelConfig,
    forward,
    get_attention_backend,
    load_model,
)
from kvpage.model.params import Params  # noqa: E402
from kvpage.runner import ModelRunner, StepOutput, StepPlan  # noqa: E402
from kvpage.runner.kv_cache import KVCacheSpec, allocate_kv_cache  # noqa: E402
from kvpage.sampling import DeviceSamplingParams  # noqa: E402

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=512,
)


# --------------------------------------------------------------------------- HF models
# Tiny configs of the other architectures: a few experts, Gemma's habits, Phi-3's partial
# RoPE; windows wider than the tests' contexts unless a test narrows them.
ARCH_OVERRIDES: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True, mlp_only_layers=[1]),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32,
                  pad_token_id=0, eos_token_id=1, bos_token_id=None),
    "gemma": dict(pad_token_id=0, eos_token_id=1, bos_token_id=2),
    "gemma2": dict(query_pre_attn_scalar=24, sliding_window=512,
                   layer_types=["sliding_attention", "full_attention"],
                   pad_token_id=0, eos_token_id=1, bos_token_id=2),
    "gemma3": dict(query_pre_attn_scalar=24, sliding_window=512, rope_local_base_freq=500.0,
                   layer_types=["sliding_attention", "full_attention"],
                   pad_token_id=0, eos_token_id=1, bos_token_id=2),
    "gpt_oss": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32,
                    sliding_window=512, layer_types=["sliding_attention", "full_attention"],
                    rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "truncate": False,
                                     "original_max_position_embeddings": 128,
                                     "rope_theta": 150000.0},
                    pad_token_id=0, eos_token_id=1, bos_token_id=2),
    "phi3": dict(partial_rotary_factor=0.5, pad_token_id=0, eos_token_id=1, bos_token_id=2),
}


def hf_config(arch: str, **overrides: Any) -> Any:
    """A tiny transformers config for ``arch`` (llama / mistral / qwen2 / qwen3, and the
    :data:`ARCH_OVERRIDES` architectures)."""
    import transformers

    classes = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "qwen2_moe": transformers.Qwen2MoeConfig,
        "mixtral": transformers.MixtralConfig,
        "olmoe": transformers.OlmoeConfig,
        "gemma": transformers.GemmaConfig,
        "gemma2": transformers.Gemma2Config,
        "gemma3": transformers.Gemma3TextConfig,
        "phi3": transformers.Phi3Config,
        "gpt_oss": transformers.GptOssConfig,
    }
    kwargs: dict[str, Any] = {**TINY, "head_dim": 16, **ARCH_OVERRIDES.get(arch, {})}
    if arch in ("qwen2", "qwen2_moe", "mixtral", "olmoe", "phi3"):
        kwargs.pop("head_dim")
    kwargs.update(overrides)
    return classes[arch](**kwargs)


def build_hf_model(arch: str, seed: int = 0, dtype: Any = None, **overrides: Any) -> Any:
    """A randomly initialised tiny ``*ForCausalLM`` in eval mode (float32 unless ``dtype``)."""
    import torch
    import transformers

    # Tiny models run far faster single-threaded, and do not fight JAX for the cores.
    torch.set_num_threads(1)
    config = hf_config(arch, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    # Larger weights than the default init spread the logits, so greedy argmax
    # comparisons are not decided by float rounding.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.15)
            elif "norm" in name:
                param.uniform_(0.8, 1.2)
            else:
                param.normal_(0.0, 0.1)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()


def save_hf_model(model: Any, directory: Path, **kwargs: Any) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    return directory


def hf_logits(model: Any, token_ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = model(torch.tensor([token_ids]))
    return out.logits[0].float().numpy()


def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
    return out[0, len(prompt) :].tolist()


def hf_greedy_logits(model: Any, prompt: list[int], max_new_tokens: int
                     ) -> tuple[list[int], np.ndarray]:
    """HF greedy generation with the logits of every step (``[max_new_tokens, vocab]``)."""
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    logits = np.stack([step[0].float().numpy() for step in out.logits])
    return out.sequences[0, len(prompt) :].tolist(), logits


# --------------------------------------------------------------------------- forward helper
def prefill_logits(
    config: ModelConfig, params: Params, token_ids: list[int], block_size: int = 4
) -> np.ndarray:
    """Logits at every position of one prompt, straight through :func:`forward`."""
    n = len(token_ids)
    num_blocks = math.ceil(n / block_size) + 1
    pools = allocate_kv_cache(
        KVCacheSpec.for_model(config, block_size, num_blocks, "float32"), None
    )
    blocks = np.arange(num_blocks - 1, -1, -1, dtype=np.int32)[: math.ceil(n / block_size)]
    positions = np.arange(n, dtype=np.int32)
    meta = AttentionMetadata(
        slot_mapping=jnp.asarray(blocks[positions // block_size] * block_size
                                 + positions % block_size),
        block_tables=jnp.asarray(blocks[None, :]),
        kv_lens=jnp.asarray([n], jnp.int32),
        cu_q_lens=jnp.asarray([0, n], jnp.int32),
        num_seqs=jnp.asarray([1], jnp.int32),
    )
    logits, _ = jax.jit(
        lambda p, pools: forward(
            p, config, jnp.asarray(token_ids, jnp.int32), jnp.asarray(positions), pools, meta,
            jnp.arange(n, dtype=jnp.int32), get_attention_backend(None),
        )
    )(params, pools)
    return np.asarray(logits)


def paged_greedy(
    config: ModelConfig, params: Params, prompt: list[int], max_new_tokens: int,
    block_size: int = 4,
) -> tuple[list[int], np.ndarray]:
    """Greedy decoding of one prompt straight through :func:`forward` (no model runner,
    so no ``max_model_len`` cap): the prompt in one step, then one token per step on the
    same paged KV cache. Returns the tokens and every step's logits ``[new, vocab]``."""
    total = len(prompt) + max_new_tokens
    used = math.ceil(total / block_size)
    pools = allocate_kv_cache(
        KVCacheSpec.for_model(config, block_size, used + 1, "float32"), None
    )
    blocks = np.arange(used, 0, -1, dtype=np.int32)  # non-contiguous, block 0 unused

    @jax.jit
    def step(p: Params, pools: Any, tokens: jax.Array, positions: jax.Array) -> Any:
        n = tokens.shape[0]
        kv_len = positions[-1] + 1
        table = jnp.asarray(blocks)
        meta = AttentionMetadata(
            slot_mapping=table[positions // block_size] * block_size + positions % block_size,
            block_tables=table[None, :],
            kv_lens=kv_len[None].astype(jnp.int32),
            cu_q_lens=jnp.asarray([0, n], jnp.int32),
            num_seqs=jnp.asarray([1], jnp.int32),
        )
        return forward(p, config, tokens, positions, pools, meta,
                       jnp.asarray([n - 1], jnp.int32), get_attention_backend(None))

    tokens = list(prompt)
    logits_steps = []
    start = 0
    while len(tokens) < total:
        logits, pools = step(params, pools, jnp.asarray(tokens[start:], jnp.int32),
                             jnp.arange(start, len(tokens), dtype=jnp.int32))
        logits_steps.append(np.asarray(logits)[0])
        start = len(tokens)
        tokens.append(int(np.argmax(logits_steps[-1])))
    return tokens[len(prompt):], np.stack(logits_steps)


# --------------------------------------------------------------------------- planner
@dataclass
class PlannedSeq:
    slot: int
    tokens: list[int]
    prompt_len: int
    max_new_tokens: int
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def done(self) -> bool:
        return len(self.tokens) - self.prompt_len >= self.max_new_tokens


class PlainPlanner:
    """A toy scheduler: every unfinished sequence gets up to ``chunk_size`` new tokens per
    step (decodes take 1) until ``token_budget`` is spent; blocks come from a shuffled
    free list so block tables are not contiguous."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        token_budget: int = 64,
        chunk_size: int | None = None,
        seed: int = 0,
        decodes_first: bool = True,
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.free = list(np.random.default_rng(seed).permutation(num_blocks))
        self.token_budget = token_budget
        self.chunk_size = chunk_size or token_budget
        self.decodes_first = decodes_first
        self.seqs: list[PlannedSeq] = []
        self._last: list[PlannedSeq] = []

    def add(self, slot: int, prompt: list[int], max_new_tokens: int) -> PlannedSeq:
        seq = PlannedSeq(slot, list(prompt), len(prompt), max_new_tokens)
        self.seqs.append(seq)
        return seq

    def _ensure_blocks(self, seq: PlannedSeq, kv_len: int) -> None:
        while len(seq.blocks) * self.block_size < kv_len:
            seq.blocks.append(int(self.free.pop()))

    def next_plan(self) -> StepPlan | None:
        active = [s for s in self.seqs if not s.done]
        if self.decodes_first:
            active.sort(key=lambda s: s.num_computed < s.prompt_len)
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu = [0]
        kv_lens: list[int] = []
        tables: list[list[int]] = []
        logits_indices: list[int] = []
        sample_rows: list[int] = []
        scheduled: list[PlannedSeq] = []
        budget = self.token_budget
        for seq in active:
            todo = len(seq.tokens) - seq.num_computed
            n = min(todo, self.chunk_size, budget)
            if n <= 0:
                continue
            budget -= n
            start = seq.num_computed
            kv_len = start + n
            self._ensure_blocks(seq, kv_len)
            for pos in range(start, kv_len):
                tokens.append(seq.tokens[pos])
                positions.append(pos)
                block = seq.blocks[pos // self.block_size]
                slots.append(block * self.block_size + pos % self.block_size)
            cu.append(len(tokens))
            kv_lens.append(kv_len)
            tables.append(seq.blocks)
            if kv_len == len(seq.tokens):
                logits_indices.append(len(tokens) - 1)
                sample_rows.append(seq.slot)
            scheduled.append(seq)
        if not scheduled:
            return None
        width = max(len(t) for t in tables)
        table = np.full((len(tables), width), self.num_blocks, np.int32)
        for i, t in enumerate(tables):
            table[i, : len(t)] = t
        self._last = scheduled
        return StepPlan(
            token_ids=np.asarray(tokens, np.int32),
            positions=np.asarray(positions, np.int32),
            slot_mapping=np.asarray(slots, np.int32),
            cu_q_lens=np.asarray(cu, np.int32),
            kv_lens=np.asarray(kv_lens, np.int32),
            block_tables=table,
            logits_indices=np.asarray(logits_indices, np.int32),
            sample_rows=np.asarray(sample_rows, np.int32),
        )

    def commit(self, plan: StepPlan, sampled: np.ndarray) -> None:
        """Advance the scheduled sequences and append the sampled tokens."""
        by_slot = dict(zip(plan.sample_rows.tolist(), sampled.tolist(), strict=True))
        for i, seq in enumerate(self._last):
            seq.num_computed = int(plan.kv_lens[i])
            if seq.slot in by_slot:
                seq.tokens.append(by_slot[seq.slot])
            if seq.done:
                self.free.extend(seq.blocks)
                seq.blocks = []


def generate(
    runner: ModelRunner,
    prompts: list[list[int]],
    max_new_tokens: int,
    params: DeviceSamplingParams | list[DeviceSamplingParams] | None = None,
    slots: list[int] | None = None,
    outputs: list[tuple[StepPlan, StepOutput]] | None = None,
    **planner_kwargs: Any,
) -> list[list[int]]:
    """Run prompts to completion through ``runner`` with a :class:`PlainPlanner`.

    ``slots`` picks each prompt's request slot (default 0, 1, ...); ``outputs`` collects
    every executed plan with its :class:`StepOutput`.
    """
    planner = PlainPlanner(runner.num_blocks, runner.block_size, **planner_kwargs)
    for i, prompt in enumerate(prompts):
        slot = slots[i] if slots else i
        p = params[i] if isinstance(params, list) else params
        runner.set_request(slot, p or DeviceSamplingParams(temperature=0.0), prompt)
        planner.add(slot, prompt, max_new_tokens)
    while (plan := planner.next_plan()) is not None:
        out = runner.execute(plan)
        if outputs is not None:
            outputs.append((plan, out))
        planner.commit(plan, out.sampled_token_ids)
    return [seq.generated for seq in planner.seqs]


def tiny_runner(config: ModelConfig, params: Any, max_model_len: int = 64) -> Any:
    return ModelRunner(config, params, num_blocks=64, block_size=4,
                       max_model_len=max_model_len, max_num_seqs=4, token_buckets=(32,),
                       seq_buckets=(4,), max_logprobs=1)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def check_engine_matches_hf(model: Any, directory: Path, prompts: list[list[int]],
                            new_tokens: int) -> None:
    """Greedy tokens and every generated token's logprob, all prompts batched in shared
    steps through the model runner, against HF generating each prompt alone."""
    config, params = load_model(directory)
    expected = [hf_greedy_logits(model, p, new_tokens) for p in prompts]
    outputs: list[Any] = []
    got = generate(tiny_runner(config, params), prompts, new_tokens,
                   DeviceSamplingParams(temperature=0.0, logprobs=1), outputs=outputs,
                   token_budget=32)
    logprobs: dict[int, list[float]] = {i: [] for i in range(len(prompts))}
    for plan, out in outputs:
        for row, slot in enumerate(plan.sample_rows.tolist()):
            logprobs[slot].append(float(out.logprobs[row]))
    for i, (want_tokens, want_logits) in enumerate(expected):
        assert got[i] == want_tokens, f"prompt {i}"
        want = log_softmax(want_logits)[np.arange(new_tokens), want_tokens]
        assert np.abs(np.asarray(logprobs[i]) - want).max() <= 1e-4, f"prompt {i}"
