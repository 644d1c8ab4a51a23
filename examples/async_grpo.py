"""GRPO with asynchronous rollouts on kvpage: the next batch samples while the trainer
steps on the last one, in a plain JAX loop (tunix 0.1.7's ``GRPOLearner`` is
synchronous: it samples, then trains).

The policy is the tiny model shipped with kvpage; the reward is the share of ``e`` in a
completion's text. Each step: ``submit`` the next batch (it starts generating at once on
the rollout thread), ``collect`` the batch submitted one step earlier, train on it with
group-normalised advantages (REINFORCE on the dense training forward,
:func:`kvpage.model.dense.token_logprobs`), ``push_params`` the new weights (they land at
the next engine step; samples in flight go on under them, their tokens tagged with the
version that produced them). ``--max-staleness`` bounds how old a sample's start may be.

::

    pip install optax
    python examples/async_grpo.py --steps 12

Prints, per step, the mean reward, the versions the batch's tokens came from, and how
much of the step the trainer spent waiting for samples.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from kvpage import LLM, SamplingParams
from kvpage.assets import default_model_dir
from kvpage.model.dense import token_logprobs
from kvpage.rl import AsyncRollouts, RolloutSample

PROMPTS = ["The function returns", "This module provides", "If the value is",
           "Use this option to"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    args = parser.parse_args()

    llm = LLM(str(default_model_dir()), max_num_seqs=64, max_model_len=128)
    engine = llm.engine
    config, tokenizer = engine.model_config, engine.tokenizer
    params = engine.runner.base_params()
    optimizer = optax.adam(args.learning_rate)
    opt_state = optimizer.init(params)
    length = 16 + args.max_tokens

    def loss_fn(p: Any, tokens: jax.Array, mask: jax.Array, adv: jax.Array) -> jax.Array:
        logp = token_logprobs(p, config, tokens)
        per_sample = jnp.sum(logp * mask, axis=1) / jnp.maximum(jnp.sum(mask, axis=1), 1.0)
        return -jnp.mean(adv * per_sample)

    @jax.jit
    def train_step(p: Any, state: Any, tokens: jax.Array, mask: jax.Array, adv: jax.Array
                   ) -> tuple[Any, Any]:
        updates, state = optimizer.update(jax.grad(loss_fn)(p, tokens, mask, adv), state, p)
        return optax.apply_updates(p, updates), state

    def batch(step: int) -> tuple[list[str], list[SamplingParams]]:
        prompts = [p for p in PROMPTS for _ in range(args.samples)]
        return prompts, [SamplingParams(temperature=1.0, max_tokens=args.max_tokens,
                                        seed=step * 1000 + i) for i in range(len(prompts))]

    rollouts = AsyncRollouts(llm, max_staleness=args.max_staleness, on_stale="resume")
    rollouts.submit(*batch(0))
    size = len(PROMPTS) * args.samples
    for step in range(args.steps):
        rollouts.submit(*batch(step + 1))  # generates while this step trains
        waited = time.perf_counter()
        samples = rollouts.collect(count=size)
        waited = time.perf_counter() - waited
        start = time.perf_counter()
        rows, masks, advantages, rewards = [], [], [], []
        groups: dict[tuple[int, ...], list[RolloutSample]] = defaultdict(list)
        for s in samples:
            groups[tuple(s.prompt_token_ids)].append(s)
        for group in groups.values():
            scores = [_reward(tokenizer.decode(s.token_ids.tolist())) for s in group]
            mean, std = float(np.mean(scores)), float(np.std(scores)) + 1e-4
            for s, score in zip(group, scores, strict=True):
                ids = (s.prompt_token_ids + s.token_ids.tolist())[:length]
                row = np.zeros(length, np.int32)
                row[: len(ids)] = ids
                mask = np.zeros(length - 1, np.float32)
                mask[len(s.prompt_token_ids) - 1 : len(ids) - 1] = 1.0
                rows.append(row)
                masks.append(mask)
                advantages.append((score - mean) / std)
                rewards.append(score)
        params, opt_state = train_step(params, opt_state, jnp.asarray(np.stack(rows)),
                                       jnp.asarray(np.stack(masks)),
                                       jnp.asarray(advantages, jnp.float32))
        jax.block_until_ready(params)
        rollouts.push_params(params)
        versions = sorted({v for s in samples for _, v in s.params_versions})
        print(f"step {step}: mean reward {np.mean(rewards):.3f} over {len(samples)} samples, "
              f"token versions {versions}, waited {waited:.2f} s for samples, trained "
              f"{time.perf_counter() - start:.2f} s", flush=True)
    rollouts.close()


def _reward(text: str) -> float:
    return text.count("e") / max(len(text), 1)


if __name__ == "__main__":
    main()
