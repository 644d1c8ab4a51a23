"""Build a tiny random Llama as an HF-format directory, with no download.

``config.json``, ``model.safetensors``, ``generation_config.json`` and a
byte-level BPE tokenizer trained in a second on a small built-in text (with
a chat template), so tests, examples and the README's main command have a
real model directory to load. The weights are random: the text it writes is
gibberish, but every code path of loading, tokenizing, scheduling and
sampling is real.

    python -m kvpage.model.tiny_model /tmp/tiny-llama
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
_CORPUS = """
Serving one request is easy; serving thousands at once is the problem. Continuous batching
schedules one step at a time: after every step finished sequences leave and waiting ones join.
PagedAttention stores the KV cache in fixed-size blocks from one pool, mapped per sequence by a
page table and allocated on demand. Copy-on-write blocks share prompt prefixes and samples.
The quick brown fox jumps over the lazy dog. Hello world! How are you today? I am fine, thanks.
Once upon a time there was a little model that wanted to write stories about the sea and the sky.
0 1 2 3 4 5 6 7 8 9 10 100 1000. Ünïcödé, émojis 🙂 and 中文 text must round-trip byte by byte.
"""


def build_tokenizer(vocab_size: int = 512, texts: Iterable[str] | None = None) -> Any:
    """A byte-level BPE tokenizer (``PreTrainedTokenizerFast``) with the chat
    template, trained on ``texts`` (default: the small built-in text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4 if texts is None else texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="</s>",
        additional_special_tokens=SPECIAL_TOKENS[3:],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_llama_config(vocab_size: int, **overrides: object) -> dict:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    config.update(overrides)
    return config


def random_llama_tensors(config: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """HF-named float32 tensors for a Llama config, scaled like an init."""
    rng = np.random.default_rng(seed)
    h, i = config["hidden_size"], config["intermediate_size"]
    d = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    v = config["vocab_size"]

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.08).astype(np.float32)

    tensors = {"model.embed_tokens.weight": w(v, h), "model.norm.weight": np.ones(h, np.float32)}
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        tensors |= {
            p + "self_attn.q_proj.weight": w(q, h),
            p + "self_attn.k_proj.weight": w(kv, h),
            p + "self_attn.v_proj.weight": w(kv, h),
            p + "self_attn.o_proj.weight": w(h, q),
            p + "mlp.gate_proj.weight": w(i, h),
            p + "mlp.up_proj.weight": w(i, h),
            p + "mlp.down_proj.weight": w(h, i),
            p + "input_layernorm.weight": np.ones(h, np.float32),
            p + "post_attention_layernorm.weight": np.ones(h, np.float32),
        }
    if not config.get("tie_word_embeddings"):
        tensors["lm_head.weight"] = w(v, h)
    return tensors


def build_tiny_model(path: str | Path, seed: int = 0, **config_overrides: object) -> Path:
    """Write a tiny random Llama with a tokenizer to ``path``; returns it."""
    from safetensors.numpy import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = tiny_llama_config(len(tokenizer), **config_overrides)
    tokenizer.save_pretrained(path)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    generation = {"bos_token_id": 1, "eos_token_id": [2, 3]}
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2))
    save_file(random_llama_tensors(config, seed), str(path / "model.safetensors"))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("path", help="directory to write the model to")
    parser.add_argument("--seed", type=int, default=0, help="weight seed")
    args = parser.parse_args()
    print(build_tiny_model(args.path, args.seed))


if __name__ == "__main__":
    main()
