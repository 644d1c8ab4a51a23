"""Train a tiny Llama with optax and sample from its live params through kvpage.

Everything runs offline on a CPU in a few minutes:

1. **Corpus.** English prose from the Python standard library that ships with the
   interpreter running this script: the reference-documentation topics in
   ``pydoc_data/topics.py`` plus the docstrings of the stdlib modules, filtered to
   prose-like paragraphs. Both are distributed under the PSF License Agreement
   (version 2), a permissive licence; see ``LICENSE.txt`` next to the stdlib.
2. **Tokenizer.** A byte-level BPE (Hugging Face ``tokenizers``) trained on that text.
3. **Training.** A small Llama (8 query and 8 KV heads, so it shards up to
   ``tensor_parallel_size=8``) trained with ``optax.adamw`` on next-token prediction.
   The params pytree is kvpage's own layout (:mod:`kvpage.model.params`) and the
   training forward pass is :func:`kvpage.model.dense.causal_lm_loss`, which shares
   every layer with the paged inference path.
4. **Sampling from live params.** Every ``--sample-every`` steps the current params go
   straight into the engine with ``llm.update_params(params)`` -- no files, no host
   round trip, no recompilation -- and a few prompts are decoded.
5. **RL-style rollout.** ``n`` samples per prompt (the engine forks the prompt's KV
   blocks copy-on-write), a toy reward (how many of the generated words are words of
   the corpus), group-normalised advantages and a REINFORCE step on the sampled
   tokens, repeated a few times; the outputs record which params version produced
   which tokens.
6. **Export.** ``--out DIR`` writes the language model (before the RL steps) as an
   HF-format directory (``config.json``, ``model.safetensors``, tokenizer files) that
   ``kvpage generate DIR`` loads.

::

    PYTHONPATH=python python examples/train_and_sample.py --out /tmp/stdlib-llama
    # the same over 2 simulated devices: sharded training, TP=2 sampling, zero copies
    XLA_FLAGS=--xla_force_host_platform_device_count=2 PYTHONPATH=python \
        python examples/train_and_sample.py --tensor-parallel-size 2

The defaults (300 steps of 32 x 128 tokens, capped at 5 minutes) take about four
minutes on two CPU cores and already write recognisable sentences.

The model kvpage ships as its default (``kvpage/assets/default_model``) was made by
this script; its ``MODEL_CARD.md`` records the exact command. ``optax`` is the only
extra dependency (``pip install optax``).
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import re
import sys
import sysconfig
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

try:
    import optax
except ImportError:  # pragma: no cover - depends on the environment
    sys.exit("this example needs optax: pip install optax")

from kvpage import LLM, SamplingParams
from kvpage.model import ModelConfig, random_params
from kvpage.model.dense import causal_lm_loss, token_logprobs
from kvpage.model.params import Params, iter_leaves
from kvpage.parallel import make_mesh, shard_params
from kvpage.tiny_model import build_tokenizer

EOS_ID = 2  # "</s>" in SPECIAL_TOKENS
_SKIPPED_STDLIB_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "turtledemo"}


# ----------------------------------------------------------------------------- corpus
def _is_prose(paragraph: str) -> bool:
    words = paragraph.split()
    if len(words) < 6 or paragraph.startswith((">>>", "$", "...")):
        return False
    letters = sum(c.isalpha() or c == " " for c in paragraph)
    return letters / len(paragraph) > 0.85


def _stdlib_docstrings() -> Iterator[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        if _SKIPPED_STDLIB_DIRS & set(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc:
                    yield doc


def stdlib_corpus() -> list[str]:
    """Prose paragraphs of the Python reference topics and the stdlib docstrings.

    Source: the running interpreter's ``pydoc_data.topics`` and ``Lib/**/*.py``
    (PSF License Agreement v2). One paragraph per entry, whitespace normalised.
    """
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions split pydoc_data out
        topics = {}
    texts = [topics[key] for key in sorted(topics)]
    texts += list(_stdlib_docstrings())
    seen: set[str] = set()
    paragraphs = []
    for text in texts:
        for block in re.split(r"\n\s*\n", text):
            paragraph = " ".join(block.split())
            if paragraph not in seen and _is_prose(paragraph):
                seen.add(paragraph)
                paragraphs.append(paragraph)
    if not paragraphs:
        raise RuntimeError("found no stdlib text to train on")
    return paragraphs


# ----------------------------------------------------------------------------- tokenizer
def train_tokenizer(paragraphs: list[str], vocab_size: int) -> Any:
    """A byte-level BPE fitted to the corpus, as a ``PreTrainedTokenizerFast``
    with the same special tokens and chat template as kvpage's tiny models."""
    return build_tokenizer(vocab_size, texts=paragraphs)


def token_stream(tokenizer: Any, paragraphs: list[str]) -> np.ndarray:
    """All paragraphs tokenized back to back, separated by a blank line (no ``</s>``:
    the model keeps writing paragraph after paragraph until ``max_tokens``)."""
    encoded = tokenizer(paragraphs, add_special_tokens=False)["input_ids"]
    separator = tokenizer("\n\n", add_special_tokens=False)["input_ids"]
    pieces = [np.asarray([*ids, *separator], np.int32) for ids in encoded]
    return np.concatenate(pieces)


# ----------------------------------------------------------------------------- model
def hf_config(vocab_size: int, args: argparse.Namespace) -> dict[str, Any]:
    """The HF ``config.json`` of the model being trained."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size,
        "num_hidden_layers": args.num_layers,
        "num_attention_heads": args.num_heads,
        "num_key_value_heads": args.num_heads,
        "head_dim": args.hidden_size // args.num_heads,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": args.max_position_embeddings,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": EOS_ID,
        "torch_dtype": "float32",
    }


MODEL_CARD = """# kvpage default model

A tiny Llama-architecture language model ({num_params:.2f}M parameters, {layers} layers,
hidden size {hidden}, {heads} query and {heads} KV heads, byte-level BPE vocabulary of
{vocab} tokens, float32). It exists so that `kvpage generate` prints real text on a
fresh CPU-only machine; it writes English in the style of Python documentation, not
facts, and is not meant for any other use.

## Training data

English prose paragraphs extracted from the Python {python} standard library that
ships with the interpreter: the reference-documentation topics of
`pydoc_data/topics.py` and the docstrings of the standard-library modules (tests,
IDLE, lib2to3 and turtledemo skipped), {paragraphs} paragraphs, {chars:.2f}M characters.
That text is distributed under the PSF License Agreement (version 2), a permissive
licence (see the `LICENSE.txt` file of the Python distribution). Nothing was downloaded.

## Training

`examples/train_and_sample.py` in the kvpage repository, on CPU:

    {command}

{steps} optimizer steps (AdamW, warmup + cosine schedule, batch {batch} x {seq_len} tokens)
in {minutes:.1f} minutes; final training loss {loss:.2f} (perplexity {ppl:.0f}).
The weights are released with kvpage under the Apache-2.0 licence.
"""


def save_model(
    path: Path,
    config: dict[str, Any],
    model_config: ModelConfig,
    params: Params,
    tokenizer: Any,
    card: dict[str, Any] | None = None,
) -> None:
    """Write an HF-format directory that ``kvpage generate`` (and transformers) load,
    with a ``MODEL_CARD.md`` filled from ``card``."""
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: np.asarray(jax.device_get(value), np.float32)
        for name, value, _ in iter_leaves(model_config, params)
    }
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": 1, "eos_token_id": [EOS_ID, 3]}
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tokenizer.save_pretrained(path)
    if card is not None:
        (path / "MODEL_CARD.md").write_text(MODEL_CARD.format(**card))


# ----------------------------------------------------------------------------- sampling
def show_samples(llm: LLM, prompts: list[str], max_tokens: int, step: int) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    for out in llm.generate(prompts, greedy, use_tqdm=False):
        completion = out.outputs[0]
        text = (out.prompt + completion.text).replace("\n", " ")
        print(f"  [step {step} | params v{completion.params_versions[0][1]}] {text}")


def word_reward(text: str, vocabulary: set[str]) -> float:
    """Toy reward: the fraction of generated words that are words of the corpus."""
    words = re.findall(r"[A-Za-z]+", text)
    if len(words) < 3:
        return 0.0
    return sum(w.lower() in vocabulary for w in words) / len(words)


def rl_rollouts(
    llm: LLM,
    params: Params,
    model_config: ModelConfig,
    vocabulary: set[str],
    args: argparse.Namespace,
    param_sharding: Any,
) -> Params:
    """A few GRPO-flavoured policy-gradient steps on engine rollouts (n per prompt)."""
    prompts = ["The function returns", "This module provides", "If the value is"]
    optimizer = optax.adam(args.rl_learning_rate)
    opt_state = optimizer.init(params)
    length = args.rl_max_tokens + 16

    def loss_fn(p: Params, tokens: jax.Array, mask: jax.Array, adv: jax.Array) -> jax.Array:
        logp = token_logprobs(p, model_config, tokens)  # [B, L - 1]
        per_sample = jnp.sum(logp * mask, axis=1) / jnp.maximum(jnp.sum(mask, axis=1), 1.0)
        return -jnp.mean(adv * per_sample)

    @jax.jit
    def rl_step(p: Params, state: Any, tokens: jax.Array, mask: jax.Array, adv: jax.Array):
        grads = jax.grad(loss_fn)(p, tokens, mask, adv)
        updates, state = optimizer.update(grads, state, p)
        return _constrain(optax.apply_updates(p, updates), param_sharding), state

    for iteration in range(args.rl_iterations):
        sampling = SamplingParams(
            n=args.rl_samples, temperature=1.0, max_tokens=args.rl_max_tokens, seed=iteration
        )
        outputs = llm.generate(prompts, sampling, use_tqdm=False)
        rows, masks, advantages, rewards = [], [], [], []
        for out in outputs:
            group = [word_reward(c.text, vocabulary) for c in out.outputs]
            mean, std = float(np.mean(group)), float(np.std(group)) + 1e-4
            for completion, reward in zip(out.outputs, group, strict=True):
                ids = (list(out.prompt_token_ids) + list(completion.token_ids))[:length]
                row = np.full(length, EOS_ID, np.int32)
                row[: len(ids)] = ids
                mask = np.zeros(length - 1, np.float32)
                mask[len(out.prompt_token_ids) - 1 : len(ids) - 1] = 1.0
                rows.append(row)
                masks.append(mask)
                advantages.append((reward - mean) / std)
                rewards.append(reward)
        versions = {tuple(c.params_versions[0]) for o in outputs for c in o.outputs}
        best = max(
            (c for o in outputs for c in o.outputs), key=lambda c: word_reward(c.text, vocabulary)
        )
        print(
            f"  rollout {iteration}: {len(rows)} samples ({args.rl_samples} per prompt, "
            f"CoW-forked prompts), mean reward {np.mean(rewards):.3f}, "
            f"params versions {sorted(versions)}; best: {best.text.strip()[:70]!r}"
        )
        params, opt_state = rl_step(
            params,
            opt_state,
            jnp.asarray(np.stack(rows)),
            jnp.asarray(np.stack(masks)),
            jnp.asarray(advantages, jnp.float32),
        )
        llm.update_params(params)
    return params


def _constrain(params: Params, sharding: Any) -> Params:
    if sharding is None:
        return params
    return jax.lax.with_sharding_constraint(params, sharding)


# ----------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--minutes", type=float, default=5.0, help="wall-clock cap on training")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps (sets the LR schedule)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--learning-rate", type=float, default=3e-3)
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--intermediate-size", type=int, default=384)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--num-heads", type=int, default=8, help="query heads = KV heads")
    p.add_argument(
        "--max-position-embeddings", type=int, default=256, help="written to config.json"
    )
    p.add_argument("--sample-every", type=int, default=100, help="steps between samples")
    p.add_argument("--sample-tokens", type=int, default=24)
    p.add_argument("--rl-iterations", type=int, default=3, help="0 skips the RL part")
    p.add_argument("--rl-samples", type=int, default=8, help="samples per prompt (n)")
    p.add_argument("--rl-max-tokens", type=int, default=24)
    p.add_argument("--rl-learning-rate", type=float, default=3e-4)
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="shard training and sampling over this many devices (same layout: no copies)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write the trained HF model here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    paragraphs = stdlib_corpus()
    rng = np.random.default_rng(args.seed)
    order = rng.permutation(len(paragraphs))
    paragraphs = [paragraphs[i] for i in order]
    tokenizer = train_tokenizer(paragraphs, args.vocab_size)
    stream = token_stream(tokenizer, paragraphs)
    vocabulary = {
        w for w, c in Counter(re.findall(r"[a-z]+", " ".join(paragraphs).lower())).items() if c >= 3
    }
    print(
        f"corpus: {len(paragraphs)} paragraphs, {sum(map(len, paragraphs)) / 1e6:.2f}M chars, "
        f"{len(stream) / 1e6:.2f}M tokens (vocab {len(tokenizer)}) "
        f"in {time.perf_counter() - start:.1f}s"
    )

    config = hf_config(len(tokenizer), args)
    model_config = ModelConfig.from_hf_dict(config)
    params = random_params(model_config, seed=args.seed, dtype="float32", scale=0.05)
    param_sharding = None
    if args.tensor_parallel_size > 1:
        mesh = make_mesh(args.tensor_parallel_size)
        params = shard_params(model_config, params, mesh)
        param_sharding = jax.tree_util.tree_map(lambda x: x.sharding, params)
    num_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
    num_leaves = len(jax.tree_util.tree_leaves(params))
    print(f"model: {num_params / 1e6:.2f}M params, {json.dumps(config)}")

    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.learning_rate, min(100, args.steps // 10), args.steps, args.learning_rate / 10
    )
    optimizer = optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.98, weight_decay=0.01)
    )
    opt_state = optimizer.init(params)

    # Train-step outputs keep the params' sharding, so update_params copies nothing.
    @jax.jit
    def train_step(p: Params, state: Any, batch: jax.Array) -> tuple[Params, Any, jax.Array]:
        loss, grads = jax.value_and_grad(causal_lm_loss)(p, model_config, batch)
        updates, state = optimizer.update(grads, state, p)
        return _constrain(optax.apply_updates(p, updates), param_sharding), state, loss

    llm = LLM.from_params(
        model_config,
        params,
        tokenizer=tokenizer,
        max_num_seqs=32,
        max_num_batched_tokens=256,
        max_model_len=256,
        block_size=16,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    prompts = ["Once upon a time", "The module", "This function"]
    show_samples(llm, prompts, args.sample_tokens, 0)
    compiles = llm.engine.runner.num_compilations

    window = args.seq_len + 1
    deadline = time.perf_counter() + 60 * args.minutes
    losses: list[float] = []
    step = 0
    train_start = time.perf_counter()
    while step < args.steps and time.perf_counter() < deadline:
        starts = rng.integers(0, len(stream) - window, args.batch_size)
        batch = jnp.asarray(np.stack([stream[s : s + window] for s in starts]))
        params, opt_state, loss = train_step(params, opt_state, batch)
        step += 1
        losses.append(float(loss))
        if step % args.sample_every == 0:
            elapsed = time.perf_counter() - train_start
            print(
                f"step {step}: loss {np.mean(losses[-args.sample_every :]):.3f} "
                f"({elapsed:.0f}s, {step * args.batch_size * args.seq_len / elapsed:.0f} tok/s)"
            )
            llm.update_params(params)  # live weights: next engine step uses them
            copies = llm.engine.runner.last_update_copies
            print(f"  update_params: {copies} of {num_leaves} arrays had to be copied")
            show_samples(llm, prompts, args.sample_tokens, step)
    llm.update_params(params)
    train_seconds = time.perf_counter() - train_start
    final_loss = float(np.mean(losses[-50:]))
    print(
        f"trained {step} steps in {train_seconds:.0f}s, final loss "
        f"{final_loss:.3f} (perplexity {math.exp(final_loss):.1f})"
    )
    show_samples(llm, prompts, args.sample_tokens, step)
    print(
        f"engine compilations: {compiles} after the first samples, "
        f"{llm.engine.runner.num_compilations} now (update_params never recompiles)"
    )

    if args.out is not None:  # the language model, before the toy RL below
        card = {
            "num_params": num_params / 1e6,
            "layers": args.num_layers,
            "hidden": args.hidden_size,
            "heads": args.num_heads,
            "vocab": len(tokenizer),
            "python": ".".join(map(str, sys.version_info[:3])),
            "paragraphs": len(paragraphs),
            "chars": sum(map(len, paragraphs)) / 1e6,
            "command": "PYTHONPATH=python python " + " ".join(sys.argv),
            "steps": step,
            "batch": args.batch_size,
            "seq_len": args.seq_len,
            "minutes": train_seconds / 60,
            "loss": final_loss,
            "ppl": math.exp(final_loss),
        }
        save_model(args.out, config, model_config, params, tokenizer, card)
        print(f"saved the model to {args.out}")

    if args.rl_iterations:
        print("RL-style rollouts (n samples per prompt through CoW forks):")
        rl_rollouts(llm, params, model_config, vocabulary, args, param_sharding)
    print(f"total {time.perf_counter() - start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
