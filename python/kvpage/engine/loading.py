"""What an engine is built from: the weights and tokenizer of an HF model directory or a
GGUF file, the end-of-sequence ids they agree on, and the JAX runner over the weights."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from kvpage.engine.config import EngineConfig
from kvpage.model.config import ModelConfig
from kvpage.model.gguf_loader import load_gguf
from kvpage.model.gguf_metadata import is_gguf
from kvpage.model.gguf_tokenizer import load_gguf_tokenizer
from kvpage.model.loader import load_model
from kvpage.model.tokenizer_cache import load_through_cache
from kvpage.runner.model_runner import ModelRunner

logger = logging.getLogger("kvpage.engine.llm_engine")


def load_tokenizer(model_dir: str | Path) -> Any:
    """The model's Hugging Face tokenizer, from local files only."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as err:  # transformers raises many types; name the directory
        raise ValueError(f"cannot load the tokenizer of {model_dir}: {err}") from None


MOE_DENSE_COMPUTE_ENV = "KVPAGE_MOE_DENSE_COMPUTE"
"""Set to 1, a MoE model computes every expert for every token: the dense-compute
baseline ``kvpage bench moe`` serves beside the routed model (never a default)."""


def _with_baseline(config: ModelConfig) -> ModelConfig:
    if config.moe is None or os.environ.get(MOE_DENSE_COMPUTE_ENV) != "1":
        return config
    logger.warning("%s=1: every expert runs for every token (benchmark baseline)",
                   MOE_DENSE_COMPUTE_ENV)
    return config.with_overrides(moe=dataclasses.replace(config.moe, dense_compute=True))


def load_model_and_tokenizer(
    model: str | Path,
    dtype: str = "auto",
    quantization: str = "auto",
    tensor_parallel_size: int = 1,
    tokenizer_cache_dir: Path | None = None,
) -> tuple[ModelConfig, Any, Any, Path | None]:
    """``(model_config, params, tokenizer, model_dir)`` from an HF model directory or a
    GGUF file (``model_dir`` is None for a GGUF file; ``tokenizer`` None if there is
    none). ``quantization``: :mod:`kvpage.quant.modes`. With ``tokenizer_cache_dir`` a
    start after the first reads the tokenizer without transformers
    (:mod:`kvpage.model.tokenizer_cache`)."""
    path = Path(model)
    if is_gguf(path):
        start = time.perf_counter()
        model_config, params, _ = load_gguf(
            path, dtype=dtype, quantization=quantization,
            tensor_parallel_size=tensor_parallel_size, tokenizer=False,
        )
        tokenizer = load_through_cache(path, tokenizer_cache_dir,
                                       lambda: load_gguf_tokenizer(path))
        logger.info("loaded %s (%s) in %.1f s", path, model_config.dtype,
                    time.perf_counter() - start)
        return _with_baseline(model_config), params, tokenizer, None
    model_config, params = load_model(path, dtype=dtype, quantization=quantization)
    tokenizer = (
        load_through_cache(path, tokenizer_cache_dir, lambda: load_tokenizer(path))
        if (path / "tokenizer_config.json").is_file() or (path / "tokenizer.json").is_file()
        else None
    )
    return _with_baseline(model_config), params, tokenizer, path


PACK_WEIGHTS_ENV = "KVPAGE_PACK_WEIGHTS"
"""Set to 0, a loaded model keeps GGUF's row order (A/B runs)."""


def pack_weights_for_host(config: EngineConfig, model_config: ModelConfig, params: Any,
                          tensor_parallel_size: int, mesh: Any) -> None:
    """Pack a loaded model's Q4_0 / Q4_1 projections and experts into tiles for the CPU
    kernels (:mod:`kvpage.quant.tiles`), in place, where those kernels are what read
    them: one CPU device, no mesh, no batch invariance, not the dense-compute baseline.
    Only for a model the engine loaded itself: live params passed in keep their layout,
    so that ``update_params`` takes trees of the same structure."""
    import jax

    from kvpage.quant.packing import pack_weights

    moe = model_config.moe
    if (mesh is not None or tensor_parallel_size != 1 or config.batch_invariant
            or (moe is not None and moe.dense_compute) or jax.default_backend() != "cpu"
            or os.environ.get(PACK_WEIGHTS_ENV) == "0"):
        return
    from kvpage.model.moe import one_host_call_applies

    packed = pack_weights(params, lambda mlp: one_host_call_applies(model_config, mlp))
    if packed:
        logger.info("packed %d weight matrices into tiles for the CPU kernels", packed)


def merge_eos_ids(config: ModelConfig, model_dir: Path | None, tokenizer: Any) -> list[int]:
    """The end-of-sequence ids of the model config, its ``generation_config.json`` and
    its tokenizer, sorted."""
    ids = set(config.eos_token_ids)
    path = None if model_dir is None else model_dir / "generation_config.json"
    if path is not None and path.is_file():
        try:
            eos = json.loads(path.read_text()).get("eos_token_id")
        except (ValueError, AttributeError) as err:
            raise ValueError(f"{path} is not a valid generation config: {err}") from None
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)


def build_model_runner(
    config: EngineConfig, model_config: ModelConfig, params: Any, max_model_len: int,
    mesh: Any = None,
) -> ModelRunner:
    """The JAX runner of ``config`` over ``params`` (on ``mesh`` if given, else on
    ``tensor_parallel_size`` devices)."""
    return ModelRunner(
        model_config,
        params,
        config.num_gpu_blocks,
        config.block_size,
        max_model_len,
        config.attention_backend,
        max_num_seqs=config.max_num_seqs,
        max_sampled_rows=config.max_sampled_rows,
        max_num_batched_tokens=config.step_token_budget(max_model_len),
        max_logprobs=config.max_logprobs,
        seed=config.seed,
        tensor_parallel_size=config.tensor_parallel_size,
        mesh=mesh,
        kv_memory_fraction=config.gpu_memory_utilization,
        kv_cache_memory=config.kv_cache_memory,
        kv_cache_dtype=config.kv_cache_dtype,
        num_scheduler_steps=config.num_scheduler_steps,
        enable_lora=config.enable_lora,
        max_loras=config.max_loras,
        max_lora_rank=config.max_lora_rank,
        batch_invariant=config.batch_invariant,
    )
