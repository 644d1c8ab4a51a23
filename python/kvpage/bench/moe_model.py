"""A random mixture-of-experts GGUF file: the model ``kvpage bench moe`` serves.

Owns :func:`write_random_moe_gguf` and :class:`MoEShape`. The file is a Qwen3-MoE
(``general.architecture = qwen3moe``) as llama.cpp's converter lays it out: stacked
expert tensors ``blk.N.ffn_{gate,up,down}_exps`` and the router ``ffn_gate_inp``, the
expert count / used count / width keys, and a byte-level tokenizer (256 byte tokens and
control-token padding), so both kvpage and ``llama-server`` load it. Weights are random
Q4_0 (or Q8_0) blocks with small scales -- decode speed does not depend on what the
weights are, and no trained MoE small enough for this machine ships on PyPI -- and
float32 norms.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

_BLOCK = {"Q4_0": (32, 18), "Q8_0": (32, 34)}


@dataclass(frozen=True)
class MoEShape:
    """The benchmark model's shape (defaults: 32 experts, top-4, ~0.3 GB of Q4_0)."""

    hidden: int = 1024
    layers: int = 8
    heads: int = 16
    kv_heads: int = 4
    head_dim: int = 64
    experts: int = 32
    top_k: int = 4
    expert_width: int = 512
    vocab: int = 4096
    context: int = 4096
    kind: str = "Q4_0"

    def expert_bytes(self) -> int:
        """Bytes of one expert's three matrices in the file."""
        elems, size = _BLOCK[self.kind]
        gate_up = 2 * self.expert_width * (self.hidden // elems) * size
        down = self.hidden * (self.expert_width // elems) * size
        return gate_up + down


def _random_blocks(rng: np.random.Generator, shape: tuple[int, ...], kind: str,
                   scale: float) -> np.ndarray:
    """Random zero-mean blocks of ``kind`` for a float tensor of ``shape`` (scales
    ``scale``).

    Zero mean matters: uniform nibbles ``0..15`` are ``q - 8`` with mean ``-0.5``, a
    shared component in every weight that after a few layers points every token's
    hidden state the same way, so every sequence greedily emitted the same token and
    routed to the same experts (a 32-request decode step then read 4 experts, not ~all
    32). Q4_0 nibbles are drawn from ``1..15`` and Q8_0 integers from ``-127..127``."""
    elems, size = _BLOCK[kind]
    *lead, inner = shape
    rows = int(np.prod(lead))
    blocks = np.empty((rows, inner // elems, size), np.uint8)
    if kind == "Q4_0":
        low, high = (rng.integers(1, 16, (rows, inner // elems, size - 2), dtype=np.uint8)
                     for _ in range(2))
        blocks[..., 2:] = low | (high << 4)
    else:
        blocks[..., 2:] = rng.integers(-127, 128, (rows, inner // elems, size - 2),
                                       dtype=np.int8).view(np.uint8)
    d = np.full((rows, inner // elems), scale, np.float16).view(np.uint8)
    blocks[..., 0:2] = d.reshape(rows, inner // elems, 2)
    return blocks.reshape(*lead, (inner // elems) * size)


def _tokens(vocab: int) -> tuple[list[str], list[int]]:
    byte_chars = [chr(c) for c in range(33, 127)] + [chr(c) for c in range(161, 173)]
    byte_chars += [chr(c) for c in range(174, 256)]
    table, n = {}, 0
    for b in range(256):
        if chr(b) in byte_chars:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    tokens = [table[b] for b in range(256)] + ["ab", "<|endoftext|>"]
    tokens += [f"<|pad{i}|>" for i in range(vocab - len(tokens))]
    types = [1] * 257 + [3] * (vocab - 257)
    return tokens, types


def write_random_moe_gguf(path: Path, shape: MoEShape = MoEShape(), seed: int = 0) -> Path:
    """Write the benchmark's random Qwen3-MoE GGUF file to ``path``."""
    import gguf

    rng = np.random.default_rng(seed)
    s = shape
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    writer.add_name("kvpage-bench-moe")
    writer.add_block_count(s.layers)
    writer.add_context_length(s.context)
    writer.add_embedding_length(s.hidden)
    writer.add_feed_forward_length(s.expert_width)
    writer.add_expert_feed_forward_length(s.expert_width)
    writer.add_expert_count(s.experts)
    writer.add_expert_used_count(s.top_k)
    writer.add_head_count(s.heads)
    writer.add_head_count_kv(s.kv_heads)
    writer.add_key_length(s.head_dim)
    writer.add_value_length(s.head_dim)
    writer.add_rope_dimension_count(s.head_dim)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    tokens, types = _tokens(s.vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(257)
    writer.add_eos_token_id(257)
    writer.add_add_bos_token(False)
    qtype = gguf.GGMLQuantizationType[s.kind]

    def quantized(name: str, dims: tuple[int, ...], scale: float = 0.002) -> None:
        writer.add_tensor(name, _random_blocks(rng, dims, s.kind, scale), raw_dtype=qtype)

    def ones(name: str, n: int) -> None:
        writer.add_tensor(name, np.ones(n, np.float32))

    quantized("token_embd.weight", (s.vocab, s.hidden), 0.02)
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    for i in range(s.layers):
        b = f"blk.{i}."
        ones(b + "attn_norm.weight", s.hidden)
        quantized(b + "attn_q.weight", (q, s.hidden))
        quantized(b + "attn_k.weight", (kv, s.hidden))
        quantized(b + "attn_v.weight", (kv, s.hidden))
        quantized(b + "attn_output.weight", (s.hidden, q))
        ones(b + "attn_q_norm.weight", s.head_dim)
        ones(b + "attn_k_norm.weight", s.head_dim)
        ones(b + "ffn_norm.weight", s.hidden)
        writer.add_tensor(b + "ffn_gate_inp.weight",
                          rng.normal(0, 0.05, (s.experts, s.hidden)).astype(np.float32))
        quantized(b + "ffn_gate_exps.weight", (s.experts, s.expert_width, s.hidden))
        quantized(b + "ffn_up_exps.weight", (s.experts, s.expert_width, s.hidden))
        quantized(b + "ffn_down_exps.weight", (s.experts, s.hidden, s.expert_width))
    ones("output_norm.weight", s.hidden)
    quantized("output.weight", (s.vocab, s.hidden), 0.02)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
