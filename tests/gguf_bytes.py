"""A tiny valid GGUF file as labelled byte chunks, and the seeded corpus of its mutations.

:func:`tiny_gguf` encodes a one-layer Llama (tied embeddings, some tensors quantized)
with :mod:`gguf_fixtures`' byte-level BPE tokenizer field by field, by hand: every
structural field of the file is its own :class:`Chunk` (``"header.n_kv"``,
``"kv7.arr_count"``, ``"ti3.dim1"``, ``"data.token_embd.weight"``, ...), so a mutation can
rewrite one count, length, type tag or offset, cut the file at any field boundary or
flip bytes. :func:`corpus` derives the mutated files from a ``random.Random(seed)``
alone, so a failing case's name reproduces it.

:func:`kv_file` and :func:`raw_kv_file` build minimal header-only files around chosen
metadata (the hostile arrays and nestings of the regression tests).
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np
from gguf_fixtures import BOS_ID, CHAT_TEMPLATE, EOS_ID, MERGES, SPECIAL_TOKENS, byte_tokens

U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
SCALAR_FORMATS = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f",
                  BOOL: "<?", U64: "<Q", I64: "<q", F64: "<d"}
ALIGNMENT = 32
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, CONTEXT = 32, 2, 1, 16, 32, 64
VOCAB = 256 + len(MERGES) + len(SPECIAL_TOKENS)
# GGUF name -> (HF/numpy shape, ggml type).
TENSORS: dict[str, tuple[tuple[int, ...], str]] = {
    "token_embd.weight": ((VOCAB, HIDDEN), "Q8_0"),
    "blk.0.attn_norm.weight": ((HIDDEN,), "F32"),
    "blk.0.attn_q.weight": ((HEADS * HEAD_DIM, HIDDEN), "F32"),
    "blk.0.attn_k.weight": ((KV_HEADS * HEAD_DIM, HIDDEN), "F16"),
    "blk.0.attn_v.weight": ((KV_HEADS * HEAD_DIM, HIDDEN), "Q4_0"),
    "blk.0.attn_output.weight": ((HIDDEN, HEADS * HEAD_DIM), "Q8_0"),
    "blk.0.ffn_norm.weight": ((HIDDEN,), "F32"),
    "blk.0.ffn_gate.weight": ((INTERMEDIATE, HIDDEN), "Q4_1"),
    "blk.0.ffn_up.weight": ((INTERMEDIATE, HIDDEN), "BF16"),
    "blk.0.ffn_down.weight": ((HIDDEN, INTERMEDIATE), "Q5_0"),
    "output_norm.weight": ((HIDDEN,), "F32"),
}


class Chunk(NamedTuple):
    label: str
    data: bytes


class Case(NamedTuple):
    name: str
    data: bytes


class RawArray(NamedTuple):
    """An ARRAY value given as its encoded elements (a hostile array built in bulk)."""

    element: int
    count: int
    payload: bytes


def u32(value: int) -> bytes:
    return struct.pack("<I", value % (1 << 32))


def u64(value: int) -> bytes:
    return struct.pack("<Q", value % (1 << 64))


def gguf_string(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return u64(len(raw)) + raw


def value_chunks(prefix: str, kind: int, value: Any) -> list[Chunk]:
    """A metadata value's chunks (``value`` of an ARRAY is ``(element type, items)``)."""
    if kind == STRING:
        raw = value.encode() if isinstance(value, str) else value
        return [Chunk(f"{prefix}.str_len", u64(len(raw))), Chunk(f"{prefix}.str", raw)]
    if kind == ARRAY and isinstance(value, RawArray):
        return [Chunk(f"{prefix}.arr_type", u32(value.element)),
                Chunk(f"{prefix}.arr_count", u64(value.count)),
                Chunk(f"{prefix}.payload", value.payload)]
    if kind == ARRAY:
        element, items = value
        if element == STRING:
            payload = b"".join(gguf_string(item) for item in items)
        elif element == ARRAY:
            payload = b"".join(
                b"".join(c.data for c in value_chunks("", ARRAY, item)) for item in items
            )
        else:
            payload = np.asarray(items, np.dtype(SCALAR_FORMATS[element])).tobytes()
        return [Chunk(f"{prefix}.arr_type", u32(element)),
                Chunk(f"{prefix}.arr_count", u64(len(items))), Chunk(f"{prefix}.payload", payload)]
    return [Chunk(f"{prefix}.scalar", struct.pack(SCALAR_FORMATS[kind], value))]


def kv_chunks(index: int, key: str, kind: int, value: Any) -> list[Chunk]:
    raw = key.encode()
    return [Chunk(f"kv{index}.key_len", u64(len(raw))), Chunk(f"kv{index}.key", raw),
            Chunk(f"kv{index}.type", u32(kind)), *value_chunks(f"kv{index}", kind, value)]


def nested(depth: int) -> bytes:
    """The bytes of an ARRAY value nested ``depth`` deep around one u8 (built inside
    out, without recursion)."""
    value = u32(U8) + u64(1) + b"\x07"
    for _ in range(depth - 1):
        value = u32(ARRAY) + u64(1) + value
    return value


def metadata() -> list[tuple[str, int, Any]]:
    """The tiny model's metadata: (key, value type, value)."""
    tokens = byte_tokens() + [m.replace(" ", "") for m in MERGES] + SPECIAL_TOKENS
    types = [1] * (256 + len(MERGES)) + [3] * len(SPECIAL_TOKENS)
    return [
        ("general.architecture", STRING, "llama"),
        ("general.alignment", U32, ALIGNMENT),
        ("general.name", STRING, "tiny fuzz base"),
        ("llama.block_count", U32, 1),
        ("llama.context_length", U32, CONTEXT),
        ("llama.embedding_length", U32, HIDDEN),
        ("llama.feed_forward_length", U32, INTERMEDIATE),
        ("llama.attention.head_count", U32, HEADS),
        ("llama.attention.head_count_kv", U32, KV_HEADS),
        ("llama.attention.key_length", U32, HEAD_DIM),
        ("llama.rope.dimension_count", U32, HEAD_DIM),
        ("llama.attention.layer_norm_rms_epsilon", F32, 1e-5),
        ("llama.rope.freq_base", F32, 10000.0),
        ("llama.vocab_size", U32, VOCAB),
        ("kvpage.test.nested", ARRAY, (ARRAY, [(U8, [1, 2]), (U8, [3])])),
        ("tokenizer.ggml.model", STRING, "gpt2"),
        ("tokenizer.ggml.pre", STRING, "default"),
        ("tokenizer.ggml.tokens", ARRAY, (STRING, tokens)),
        ("tokenizer.ggml.token_type", ARRAY, (I32, types)),
        ("tokenizer.ggml.scores", ARRAY, (F32, [0.0] * VOCAB)),
        ("tokenizer.ggml.merges", ARRAY, (STRING, MERGES)),
        ("tokenizer.ggml.bos_token_id", U32, BOS_ID),
        ("tokenizer.ggml.eos_token_id", U32, EOS_ID),
        ("tokenizer.ggml.add_bos_token", BOOL, False),
        ("tokenizer.chat_template", STRING, CHAT_TEMPLATE),
    ]


def tensor_bytes(shape: tuple[int, ...], kind: str, seed: int) -> bytes:
    import gguf
    from gguf.quants import quantize

    values = np.random.default_rng(seed).normal(0.0, 0.1, shape).astype(np.float32)
    if kind == "F32":
        return values.tobytes()
    if kind == "F16":
        return values.astype(np.float16).tobytes()
    return quantize(values, gguf.GGMLQuantizationType[kind]).tobytes()


def tiny_gguf(fields: list[tuple[str, int, Any]] | None = None) -> list[Chunk]:
    """The valid tiny file, chunk by chunk."""
    import gguf

    fields = metadata() if fields is None else fields
    infos: list[Chunk] = []
    data: list[Chunk] = []
    offset = 0
    for index, (name, (shape, kind)) in enumerate(TENSORS.items()):
        dims = tuple(reversed(shape))
        infos += [Chunk(f"ti{index}.name_len", u64(len(name))),
                  Chunk(f"ti{index}.name", name.encode()),
                  Chunk(f"ti{index}.n_dims", u32(len(dims))),
                  *(Chunk(f"ti{index}.dim{d}", u64(n)) for d, n in enumerate(dims)),
                  Chunk(f"ti{index}.type", u32(gguf.GGMLQuantizationType[kind])),
                  Chunk(f"ti{index}.offset", u64(offset))]
        raw = tensor_bytes(shape, kind, index)
        pad = -len(raw) % ALIGNMENT
        data += [Chunk(f"data.{name}", raw), Chunk(f"pad.{name}", bytes(pad))]
        offset += len(raw) + pad
    chunks = [Chunk("header.magic", b"GGUF"), Chunk("header.version", u32(3)),
              Chunk("header.n_tensors", u64(len(TENSORS))), Chunk("header.n_kv", u64(len(fields)))]
    for index, (key, kind, value) in enumerate(fields):
        chunks += kv_chunks(index, key, kind, value)
    chunks += infos
    header = sum(len(c.data) for c in chunks)
    chunks.append(Chunk("pad.header", bytes(-header % ALIGNMENT)))
    return chunks + data


def join(chunks: list[Chunk]) -> bytes:
    return b"".join(c.data for c in chunks)


def kv_file(fields: list[tuple[str, int, Any]]) -> bytes:
    """A header-only GGUF file (no tensors) holding ``fields``."""
    body = b"".join(join(kv_chunks(i, *field)) for i, field in enumerate(fields))
    return b"GGUF" + u32(3) + u64(0) + u64(len(fields)) + body


def raw_kv_file(key: str, kind: int, value: bytes) -> bytes:
    """A header-only GGUF file with one key whose value is given encoded."""
    return b"GGUF" + u32(3) + u64(0) + u64(1) + gguf_string(key) + u32(kind) + value


def replace(chunks: list[Chunk], label: str, *data: bytes) -> bytes:
    """The file with chunk ``label`` replaced by ``data`` (several chunks, or none)."""
    index = next(i for i, c in enumerate(chunks) if c.label == label)
    return join(chunks[:index]) + b"".join(data) + join(chunks[index + 1 :])


def retyped(chunks: list[Chunk], kv: str, kind: int, value: Any) -> bytes:
    """The file with metadata ``kv``'s type and value replaced (``value`` as
    :func:`value_chunks` takes it, or its encoded bytes)."""
    start = next(i for i, c in enumerate(chunks) if c.label == f"{kv}.type")
    end = start + 1
    while end < len(chunks) and chunks[end].label.startswith(f"{kv}."):
        end += 1
    raw = value if isinstance(value, bytes) else join(value_chunks("", kind, value))
    return join(chunks[:start]) + u32(kind) + raw + join(chunks[end:])


def with_offsets(chunks: list[Chunk], offset: Callable[[int, int], int]) -> bytes:
    """The file with tensor ``i``'s offset ``off`` replaced by ``offset(i, off)``."""
    out, index = [], 0
    for chunk in chunks:
        if chunk.label.endswith(".offset") and chunk.label.startswith("ti"):
            chunk = Chunk(chunk.label, u64(offset(index, struct.unpack("<Q", chunk.data)[0])))
            index += 1
        out.append(chunk)
    return join(out)


# ---------------------------------------------------------------- the corpus

_HUGE = (1 << 16) + 1, 1 << 32, 1 << 62, (1 << 63) - 1, 1 << 63, (1 << 64) - 1


def _counts(n: int) -> tuple[int, ...]:
    return (0, 1, n - 1, n + 1, 2 * n, *_HUGE)


def _header_cases(chunks: list[Chunk]) -> Iterator[Case]:
    for magic in (b"GGUG", b"\0\0\0\0", b"FUGG", b"GGU"):
        yield Case(f"magic={magic!r}", replace(chunks, "header.magic", magic))
    for version in (0, 1, 2, 4, (1 << 32) - 1):
        yield Case(f"version={version}", replace(chunks, "header.version", u32(version)))
    n_kv = len(metadata())
    for label, n in (("n_tensors", len(TENSORS)), ("n_kv", n_kv)):
        for count in _counts(n):
            yield Case(f"{label}={count}", replace(chunks, f"header.{label}", u64(count)))


def _alignment_cases(chunks: list[Chunk]) -> Iterator[Case]:
    label = next(c.label for c in chunks if c.data == b"general.alignment")
    kv = label.removesuffix(".key")
    for value in (0, 1, 2, 3, 16, 31, 48, 64, 4096, 1 << 24, 1 << 25, 1 << 31, (1 << 32) - 1):
        yield Case(f"alignment={value}", replace(chunks, f"{kv}.scalar", u32(value)))
    for kind, value in ((I32, -32), (I32, -1), (I32, 32), (I64, -(1 << 40)), (U64, 1 << 40),
                        (F32, 32.0), (BOOL, True), (STRING, "32"), (ARRAY, (U32, [32]))):
        yield Case(f"alignment={value!r} as type {kind}", retyped(chunks, kv, kind, value))
    yield Case("alignment nested 3 deep", retyped(chunks, kv, ARRAY, nested(3)))


def _field_cases(chunks: list[Chunk], rng: random.Random, n: int) -> Iterator[Case]:
    """Mutations of one metadata field each: key lengths, value types, string lengths,
    array types and lengths, values, nesting."""
    fields = metadata()
    for _ in range(n):
        index = rng.randrange(len(fields))
        key, kind, value = fields[index]
        kv = f"kv{index}"
        labels = [c.label for c in chunks if c.label.startswith(f"{kv}.")]
        label = rng.choice(labels)
        part = label.rsplit(".", 1)[1]
        original = next(c.data for c in chunks if c.label == label)
        name = f"{key}:{part}"
        if part in ("key_len", "str_len", "arr_count"):
            current = struct.unpack("<Q", original)[0]
            new = rng.choice((*_counts(current), current + rng.randrange(1, 64),
                              rng.randrange(1 << 20)))
            yield Case(f"{name}={new}", replace(chunks, label, u64(new)))
        elif part in ("type", "arr_type"):
            new = rng.choice((rng.randrange(16), rng.randrange(1 << 32), ARRAY, STRING, U64, U8))
            yield Case(f"{name}={new}", replace(chunks, label, u32(new)))
        elif part == "scalar":
            flipped = bytes(b ^ rng.randrange(1, 256) for b in original)
            yield Case(f"{name}={flipped.hex()}", replace(chunks, label, flipped))
        elif rng.random() < 0.3:  # a retyped value: a wrong-typed but well-formed field
            new_kind, new_value = rng.choice(((STRING, "x"), (U32, 0), (F32, float("nan")),
                                              (I32, -1), (BOOL, True), (ARRAY, (U8, [])),
                                              (ARRAY, (STRING, ["a"] * 3)), (U64, 1 << 63)))
            yield Case(f"{key} as {new_kind}:{new_value!r}",
                       retyped(chunks, kv, new_kind, new_value))
        else:  # key, str or payload bytes
            data = bytearray(original)
            if data:
                for _ in range(rng.randint(1, 3)):
                    data[rng.randrange(len(data))] = rng.choice((0xFF, 0xC0, 0x80, 0, 0x20))
            yield Case(f"{name} bytes {bytes(data[:24])!r}", replace(chunks, label, bytes(data)))
    for depth in (2, 3, 8, 9, 64, 500):
        index = rng.randrange(len(fields))
        yield Case(f"{fields[index][0]} nested {depth} deep",
                   retyped(chunks, f"kv{index}", ARRAY, nested(depth)))


def _tensor_cases(chunks: list[Chunk], rng: random.Random, n: int) -> Iterator[Case]:
    """Mutations of one tensor info each: n_dims, dims, types, offsets, names."""
    names = list(TENSORS)
    offsets = [struct.unpack("<Q", c.data)[0] for c in chunks if c.label.endswith(".offset")]
    size = len(join(chunks))
    for _ in range(n):
        index = rng.randrange(len(names))
        ti = f"ti{index}"
        labels = [c.label for c in chunks if c.label.startswith(f"{ti}.")]
        label = rng.choice(labels)
        part = label.rsplit(".", 1)[1]
        original = next(c.data for c in chunks if c.label == label)
        name = f"{names[index]}:{part}"
        if part == "n_dims":
            new = rng.choice((0, 1, 3, 4, 5, 64, (1 << 32) - 1))
            yield Case(f"{name}={new}", replace(chunks, label, u32(new)))
        elif part.startswith("dim"):
            current = struct.unpack("<Q", original)[0]
            new = rng.choice((0, 1, current * 2, current // 2, 1 << 32, 1 << 31, *_HUGE))
            yield Case(f"{name}={new}", replace(chunks, label, u64(new)))
        elif part == "type":
            new = rng.choice((rng.randrange(48), rng.randrange(1 << 32), 0, 1, 8, 12, 4, 31))
            yield Case(f"{name}={new}", replace(chunks, label, u32(new)))
        elif part == "offset":
            current = offsets[index]
            new = rng.choice((0, rng.choice(offsets), current + 1, current + ALIGNMENT,
                              current - ALIGNMENT, size, size - ALIGNMENT, *_HUGE))
            yield Case(f"{name}={new}", replace(chunks, label, u64(new)))
        elif part == "name":
            other = names[rng.randrange(len(names))].encode()
            new_name = other if len(other) == len(original) else b"\xff" + original[1:]
            yield Case(f"{name}={new_name!r}", replace(chunks, label, new_name))
        else:  # name_len
            current = struct.unpack("<Q", original)[0]
            new = rng.choice((0, current - 1, current + 1, 1 << 40, (1 << 64) - 1))
            yield Case(f"{name}={new}", replace(chunks, label, u64(new)))
    yield Case("every tensor at offset 0", with_offsets(chunks, lambda i, off: 0))
    yield Case("tensors overlap by one alignment",
               with_offsets(chunks, lambda i, off: max(0, off - ALIGNMENT * (i > 0))))


def _truncations(chunks: list[Chunk], rng: random.Random, n: int) -> Iterator[Case]:
    data = join(chunks)
    cuts: set[int] = set()
    position = 0
    for chunk in chunks:
        position += len(chunk.data)
        cuts.add(position)
    cuts.discard(len(data))
    cuts.update(rng.randrange(len(data)) for _ in range(n))
    for cut in sorted(cuts):
        yield Case(f"cut at {cut} of {len(data)}", data[:cut])


def _byte_flips(chunks: list[Chunk], rng: random.Random, n: int) -> Iterator[Case]:
    data = join(chunks)
    header = len(data) - sum(len(c.data) for c in chunks if c.label.startswith(("data.", "pad.")))
    for case in range(n):
        span = header if case % 2 else len(data)  # half of them inside the header
        flipped = bytearray(data)
        where = sorted(rng.randrange(span) for _ in range(rng.randint(1, 8)))
        for at in where:
            flipped[at] ^= rng.randrange(1, 256)
        yield Case(f"flips at {where}", bytes(flipped))


def hostile_numbers(n_bytes: int = 32 << 20) -> RawArray:
    """A UINT16 array of ``n_bytes`` (16M values for 32 MiB), none of them a small int
    CPython caches: about 40 bytes each as a Python list."""
    return RawArray(U16, n_bytes // 2, np.full(n_bytes // 2, 0xFFFF, np.uint16).tobytes())


def hostile_strings(n_bytes: int = 32 << 20, extra: int = 0) -> RawArray:
    """A STRING array of two-character strings filling ``n_bytes`` (about 60 bytes each as
    Python ``str``); ``extra`` more are declared than present."""
    count = n_bytes // 10
    one = np.frombuffer(u64(2) + b"ab", np.uint8)
    return RawArray(STRING, count + extra, np.tile(one, count).tobytes())


def corpus(seed: int, fields: int = 150, tensors: int = 100, truncations: int = 40,
           flips: int = 80) -> list[Case]:
    """Every mutated file of the corpus (a few hundred), deterministic in ``seed``."""
    rng = random.Random(seed)
    chunks = tiny_gguf()
    return [
        *_header_cases(chunks),
        *_alignment_cases(chunks),
        *_field_cases(chunks, rng, fields),
        *_tensor_cases(chunks, rng, tensors),
        *_truncations(chunks, rng, truncations),
        *_byte_flips(chunks, rng, flips),
    ]
