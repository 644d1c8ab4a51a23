"""kvpage as the rollout engine of tunix (Google's JAX RL library): :class:`KvpageRollout`.

Plug it into tunix's RL cluster as ``ClusterConfig(rollout_engine=KvpageRollout, ...)``
(or ``functools.partial(KvpageRollout, **engine_args)`` to pass kvpage engine
arguments). It implements tunix 0.1.7's ``BaseRollout``:

* ``generate(prompts, rollout_config)`` samples with continuous batching, paged KV and
  prefix sharing (GRPO's repeated prompts are prefilled once), and returns tunix's
  ``RolloutOutput``: completion ids without EOS, left-padded prompt ids, and with
  ``return_logprobs`` the logprob of each token under the distribution it was sampled
  from (``processed_logprobs``: after temperature and top-k/top-p, as vLLM's default
  for tunix).
* ``get_per_token_logps(prompt, completion)`` scores given completions with the current
  weights (``LLM.score``: raw logits, as tunix's own).
* ``update_params(state)`` reads the trainer's NNX state in tunix's layout
  (:mod:`kvpage.integrations.tunix_layout`): no copy, no transpose, no recompile.
  When the trainer updates the actor module in place (tunix then calls no sync:
  ``model()`` is the actor), each ``generate`` notices the new arrays and takes them.

tunix's dense Llama 3 / Qwen 2 / Qwen 3 modules and its Gemma / Gemma 2 / Gemma 3
(text-only) modules are mapped. A rollout mesh of several devices is used as it is (it
needs a ``"tp"`` axis; Llama / Qwen only: Gemma's head-first kernels have no sharding
rule yet). A qwix-LoRA actor (tunix's LoRA GRPO recipes) runs as the frozen base plus
its adapter (:mod:`kvpage.lora`); LoRA-only syncs rewrite the adapter (Llama / Qwen).
Requires ``pip install kvpage[tunix]``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

try:
    from flax import nnx
    from flax.nnx import filterlib
    from tunix.rl.rollout import base_rollout
except ImportError as e:  # pragma: no cover - exercised without the extra
    raise ImportError(
        "kvpage.integrations.tunix needs tunix and flax: pip install 'kvpage[tunix]'"
    ) from e

from kvpage.integrations.tunix_layout import (
    config_from_tunix,
    params_from_tunix,
    tunix_architecture,
    tunix_lora,
)
from kvpage.llm import LLM
from kvpage.lora.adapter import LoRAAdapter
from kvpage.lora.request import LoRARequest
from kvpage.sampling.params import SamplingParams

_BASE = filterlib.All(nnx.Param, filterlib.Not(nnx.LoRAParam))
"""The frozen base of a LoRA actor (every ``nnx.Param`` but its ``nnx.LoRAParam``s)."""


def params_leaves(state: Any) -> Any:
    """The arrays of an NNX state (variables unwrapped)."""
    return jax.tree.map(
        lambda v: v.get_value() if hasattr(v, "get_value") else v, state,
        is_leaf=lambda v: hasattr(v, "get_value"),
    )


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class KvpageRollout(base_rollout.BaseRollout):
    """A tunix rollout worker backed by a kvpage engine over the actor's own weights."""

    def __init__(
        self,
        rollout_actor: Any,
        tokenizer: Any,
        mesh: Any = None,
        rollout_config: base_rollout.RolloutConfig | None = None,
        *,
        rope_theta: float | None = None,
        lora_scaling: float | None = None,
        **engine_args: Any,
    ) -> None:
        """``rope_theta`` overrides the RoPE base the tunix module applies (see
        :data:`~kvpage.integrations.tunix_layout.TUNIX_FIXED_ROPE_THETA`);
        ``lora_scaling``: qwix's ``alpha / rank`` when the actor has LoRA params (else
        ``rollout_config.rollout_sglang_jax_lora_scaling``); ``engine_args`` go to
        :class:`kvpage.LLM` (``max_num_seqs``, ...)."""
        self._actor = rollout_actor
        self._tokenizer = tokenizer
        self.mesh = None
        self._config = rollout_config or base_rollout.RolloutConfig()
        arch = tunix_architecture(rollout_actor)
        eos = self._eos_ids(self._config)
        state = nnx.state(rollout_actor, nnx.Param)
        self.model_config = config_from_tunix(
            rollout_actor.config, architecture=arch, rope_theta=rope_theta,
            eos_token_ids=tuple(eos),
            max_position_embeddings=max(4096, self._max_len(self._config)),
            # the dtype the module computes in: its arrays' (tunix's Gemma 1/2 configs
            # name none)
            dtype=params_leaves(state)["embedder"]["input_embedding"].dtype,
        )
        self._actor_leaves = self._leaf_ids(state)
        self._base_leaves = self._leaf_ids(
            nnx.state(rollout_actor, _BASE))
        params = params_from_tunix(state, self.model_config)
        # A qwix-LoRA actor: the engine serves its adapter beside the frozen base.
        self._policy: LoRARequest | None = None
        self._lora_scale = lora_scaling if lora_scaling is not None else getattr(
            self._config, "rollout_sglang_jax_lora_scaling", None)
        lora_state = nnx.state(rollout_actor, nnx.LoRAParam)
        has_lora = bool(jax.tree.leaves(lora_state))
        if has_lora:
            if self._lora_scale is None:
                raise ValueError(
                    "the actor has LoRA params: pass KvpageRollout(lora_scaling=alpha / "
                    "rank) as qwix's LoraProvider applies it (or set "
                    "rollout_sglang_jax_lora_scaling)"
                )
            adapter = self._adapter(lora_state)
            engine_args.setdefault("enable_lora", True)
            engine_args.setdefault("max_lora_rank", adapter.rank)
        engine_args.setdefault("max_model_len", self._max_len(self._config))
        # tunix's rollout mesh as it is (weights split over its "tp" axis), or one device
        use_mesh = mesh if mesh is not None and mesh.devices.size > 1 else None
        if use_mesh is not None and arch.startswith("gemma"):
            raise NotImplementedError(
                "KvpageRollout serves tunix's Gemma modules on one device only: their "
                "head-first q/kv kernels have no tensor-parallel sharding rule yet"
            )
        self.llm = LLM.from_params(self.model_config, params, mesh=use_mesh, **engine_args)
        if has_lora:
            self._policy = LoRARequest("policy", 1)
            assert self.llm.engine.lora is not None
            self.llm.engine.lora.add_adapter(self._policy, adapter)

    # ---- BaseRollout
    def generate(
        self, prompts: list[str], rollout_config: base_rollout.RolloutConfig, **kwargs: Any
    ) -> base_rollout.RolloutOutput:
        """Sample one completion per prompt (tunix repeats a prompt for GRPO's group)."""
        self._follow_actor()
        ids = [self._tokenize(p) for p in prompts]
        longest = max((len(x) for x in ids), default=1)
        width = rollout_config.max_prompt_length
        if width is None or width < longest:
            width = _next_power_of_2(longest)
        pad = self.pad_id()
        left_padded = np.full((len(ids), width), pad, np.int32)
        for r, x in enumerate(ids):
            left_padded[r, width - len(x):] = x
        seed = rollout_config.seed
        base_seed = None if seed is None else int(np.asarray(seed).reshape(-1)[0])
        params = [
            SamplingParams(
                max_tokens=rollout_config.max_tokens_to_generate,
                temperature=float(rollout_config.temperature),
                top_p=1.0 if rollout_config.top_p is None else float(rollout_config.top_p),
                top_k=0 if rollout_config.top_k is None else int(rollout_config.top_k),
                seed=None if base_seed is None else base_seed + i,
                # tunix's eos_tokens are the whole stop set (the model's EOS included
                # only when listed), as in its own sampler
                ignore_eos=bool(rollout_config.eos_tokens),
                stop_token_ids=self._eos_ids(rollout_config),
                logprobs_mode="processed_logprobs",
            )
            for i in range(len(ids))
        ]
        batch = self.llm.rollout(
            [{"prompt_token_ids": x.tolist()} for x in ids], params, pad_id=pad,
            lora_request=self._policy,
        )
        tokens = batch.completions()
        return base_rollout.RolloutOutput(
            text=[self._tokenizer.decode(t.tolist()) for t in tokens],
            logits=None,
            tokens=tokens,
            left_padded_prompt_tokens=left_padded,
            logprobs=(
                [batch.logprobs[r, :n] for r, n in enumerate(batch.lengths.tolist())]
                if rollout_config.return_logprobs
                else None
            ),
        )

    def get_per_token_logps(
        self, prompt_tokens: jax.Array, completion_tokens: jax.Array
    ) -> jax.Array:
        """``[B, C]`` logprobs of right-padded completions after left-padded prompts
        (0 at padded completion positions)."""
        self._follow_actor()
        prompts = np.asarray(prompt_tokens)
        completions = np.asarray(completion_tokens)
        pad = self.pad_id()
        prompt_rows = [row[np.argmax(row != pad):] if (row != pad).any() else row[-1:]
                       for row in prompts]
        lengths = [int(np.argmin(np.append(row != pad, False))) for row in completions]
        scores = self.llm.score(
            [p.tolist() for p in prompt_rows],
            [row[:n].tolist() for row, n in zip(completions, lengths, strict=True)],
            lora_request=self._policy,
        )
        out = np.zeros(completions.shape, np.float32)
        for r, s in enumerate(scores):
            out[r, : len(s)] = s
        return jnp.asarray(out)

    def update_params(self, params: Any, filter_types: tuple[Any, ...] | None = None) -> None:
        """Generate with the trainer's weights ``params`` (an NNX state of the actor's
        ``nnx.Param``s) from now on: kvpage reads them where they are. A LoRA-only sync
        (``filter_types=(nnx.LoRAParam,)``, as tunix sends for a LoRA policy) rewrites the
        policy's adapter slot in one device call; the base stays, nothing recompiles."""
        lora_only = bool(filter_types) and all(
            isinstance(f, type) and issubclass(f, nnx.LoRAParam) for f in filter_types)
        if lora_only or self._policy is not None:
            if self._policy is None:
                raise ValueError("a LoRA-only sync, but the actor KvpageRollout was built "
                                 "on has no LoRA params")
            self._load_policy(params)
        if not lora_only:
            self.llm.update_params(params_from_tunix(params, self.model_config))
        # In step with the actor as it is now (tunix syncs even when the rollout's actor
        # is the trainer's own module: _follow_actor must not take the same arrays twice).
        self._actor_leaves = self._leaf_ids(nnx.state(self._actor, nnx.Param))
        self._base_leaves = self._leaf_ids(nnx.state(self._actor, _BASE))

    def pad_id(self) -> int:
        return int(self._tokenizer_call("pad_id"))

    def eos_id(self) -> int:
        return int(self._tokenizer_call("eos_id"))

    def model(self) -> Any:
        return self._actor

    # ---- helpers
    @staticmethod
    def _leaf_ids(state: Any) -> list[int]:
        return [id(x) for x in jax.tree.leaves(params_leaves(state))]

    def _adapter(self, state: Any) -> LoRAAdapter:
        """The LoRA params in ``state`` as an adapter in kvpage's layout, scaled."""
        assert self._lora_scale is not None
        pairs = tunix_lora(state, self.model_config, self._lora_scale)
        return LoRAAdapter(max((a.shape[0] for a, _ in pairs.values()), default=0), pairs)

    def _load_policy(self, state: Any) -> None:
        """The LoRA params in ``state`` as the policy's new version (its slot rewritten)."""
        assert self._policy is not None
        adapter = self._adapter(state)
        if adapter.weights:
            self.llm.engine.update_lora(self._policy, adapter)

    def _follow_actor(self) -> None:
        """When the trainer updated the actor module itself (tunix then skips
        ``update_params``: the rollout's ``model()`` *is* the actor, so it counts as
        sharing weights), take its new arrays before sampling: never stale weights."""
        state = nnx.state(self._actor, nnx.Param)
        leaves = self._leaf_ids(state)
        if leaves != self._actor_leaves:
            self._actor_leaves = leaves
            base = nnx.state(self._actor, _BASE)
            if self._leaf_ids(base) != self._base_leaves:  # a LoRA policy's base is frozen
                self._base_leaves = self._leaf_ids(base)
                self.llm.update_params(params_from_tunix(state, self.model_config))
            if self._policy is not None:
                self._load_policy(state)

    def _tokenizer_call(self, name: str) -> Any:
        attr = getattr(self._tokenizer, name, None)
        if callable(attr):
            return attr()
        hf = getattr(self._tokenizer, f"{name.removesuffix('_id')}_token_id", None)
        if name == "pad_id" and hf is None:
            hf = getattr(self._tokenizer, "eos_token_id", None)
        if hf is None:
            raise ValueError(f"the tokenizer has no {name}")
        return hf

    def _tokenize(self, text: str) -> np.ndarray:
        """As tunix's sampler: encode, BOS prepended when the tokenizer has one."""
        ids = list(self._tokenizer.encode(text))
        bos = getattr(self._tokenizer, "bos_id", None)
        bos_id = bos() if callable(bos) else getattr(self._tokenizer, "bos_token_id", None)
        if bos_id:
            ids = [bos_id] + ids
            while len(ids) > 1 and ids[0] == ids[1] == bos_id:
                ids = ids[1:]
        return np.asarray(ids, np.int32)

    def _eos_ids(self, config: base_rollout.RolloutConfig) -> list[int]:
        return list(config.eos_tokens or [self.eos_id()])

    @staticmethod
    def _max_len(config: base_rollout.RolloutConfig) -> int:
        prompt = config.max_prompt_length or 64
        return _next_power_of_2(prompt) + config.max_tokens_to_generate + 1


def tunix_llama_from_checkpoint(path: Any) -> tuple[Any, Any, Any]:
    """A tunix ``Llama3`` module holding a checkpoint kvpage reads (an HF directory or a
    GGUF file, float32), for trying kvpage and tunix on the same weights: returns
    ``(model, tokenizer, kvpage ModelConfig)``, the tokenizer wrapped in tunix's
    ``TokenizerAdapter``.

    tunix 0.1.7's Llama applies RoPE base 1e6 whatever its config says: this patches
    ``tunix.models.llama3.model.apply_rope`` (process-wide) to the checkpoint's base, so
    tunix runs the model as trained; pass the same base to ``KvpageRollout(rope_theta=
    config.rope.theta)``."""
    import functools

    from tunix.generate.tokenizer_adapter import TokenizerAdapter
    from tunix.models.llama3 import model as tunix_llama

    from kvpage.engine.llm_engine import load_model_and_tokenizer
    from kvpage.integrations.tunix_layout import tunix_arrays_from_params

    config, params, tokenizer, _ = load_model_and_tokenizer(
        path, dtype="float32", quantization="none"
    )
    if config.architecture != "LlamaForCausalLM":
        raise ValueError(f"{path} is a {config.architecture}; this loads Llama checkpoints")
    theta = config.rope.theta
    rope = getattr(tunix_llama.apply_rope, "func", tunix_llama.apply_rope)
    tunix_llama.apply_rope = functools.partial(rope, rope_theta=theta)
    model = tunix_llama.Llama3(
        tunix_llama.ModelConfig(
            num_layers=config.num_layers, vocab_size=config.vocab_size,
            embed_dim=config.hidden_size, hidden_dim=config.intermediate_size,
            num_heads=config.num_heads, head_dim=config.head_dim,
            num_kv_heads=config.num_kv_heads, rope_theta=int(theta),
            norm_eps=config.rms_norm_eps, weight_tying=config.tie_word_embeddings,
        ),
        rngs=nnx.Rngs(0),
    )
    nnx.update(model, nnx.State(tunix_arrays_from_params(config, params)))
    return model, TokenizerAdapter(tokenizer), config

