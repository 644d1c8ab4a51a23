"""The GGUF fuzz corpus and the malformed-file regressions it grew from.

Every one of a few hundred seeded mutations of a tiny valid GGUF file
(:mod:`gguf_bytes`: header fields, metadata key lengths / value types / string lengths /
array types, lengths and nesting, tensor infos, alignment values, truncation at every
field boundary and at random points, byte flips), plus hostile 32 MiB arrays, must end as
a :class:`CheckpointError` or a successful :func:`load_gguf` (config, params, tokenizer),
in bounded time and memory. The named tests pin one audit finding each: an alignment of
0 (ZeroDivisionError), negative or not a power of two (accepted); arrays nested 500 deep
(RecursionError); declared lengths trusted before the bytes are there; arrays decoded
into Python lists at ~25x their size; tensors at one offset, overlapping, misaligned or
past the end of the file; exceptions other than CheckpointError escaping the parse.
"""

from __future__ import annotations

import struct
import time
import tracemalloc
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gguf_bytes as gb
import model_fixtures  # noqa: F401  (sys.path / import setup, before kvpage)
import numpy as np
import pytest
from kvpage.model import CheckpointError
from kvpage.model import gguf_file as gguf_file_module
from kvpage.model.gguf_file import MAX_ARRAY_DEPTH, GGUFArray, GGUFFile
from kvpage.model.gguf_loader import load_gguf

SEED = 20240611
# Bounds for the whole corpus: CPU seconds (about 3 s here, under tracemalloc; the bound
# leaves room for a slower or loaded machine), one case's wall seconds, the traced peak.
CORPUS_CPU_SECONDS = 20.0
CASE_SECONDS = 5.0
CORPUS_PEAK_BYTES = 256 << 20
# One hostile file: a 32 MiB array of numbers (or 4 MiB of short strings: walking them
# under tracemalloc is slow) took ~25x (~6x) its size once decoded into a list.
HOSTILE_PEAK_BYTES = 8 << 20
STRINGS_BYTES = 4 << 20


@pytest.fixture(scope="module")
def chunks() -> list[gb.Chunk]:
    return gb.tiny_gguf()


def write(tmp_path: Path, data: bytes, name: str = "case.gguf") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def traced_peak(action: Callable[[], Any]) -> tuple[Any, int]:
    """``action()``'s result (or the CheckpointError it raised) and the peak of the
    memory Python allocated while it ran."""
    tracemalloc.start()
    try:
        try:
            result: Any = action()
        except CheckpointError as exc:
            result = exc
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def alignment_label(chunks: list[gb.Chunk]) -> str:
    return next(c.label for c in chunks if c.data == b"general.alignment").removesuffix(".key")


@pytest.fixture(autouse=True)
def quiet_dequantization() -> Iterator[None]:
    """Flipped bytes make inf/nan scales; numpy's overflow warnings are expected."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


# ---------------------------------------------------------------- the corpus


def test_the_base_file_is_valid(chunks: list[gb.Chunk], tmp_path: Path) -> None:
    """The hand-encoded base file is what the gguf package reads too, and loads."""
    import gguf

    path = write(tmp_path, gb.join(chunks))
    theirs = gguf.GGUFReader(path)
    ours = GGUFFile(path)
    assert [t.name for t in theirs.tensors] == [t.name for t in ours.tensors] == list(gb.TENSORS)
    for mine, ref in zip(ours.tensors, theirs.tensors, strict=True):
        assert (mine.data_offset, mine.n_bytes) == (ref.data_offset, ref.n_bytes)
        assert np.array_equal(mine.data, ref.data)
    nested = ours.fields["kvpage.test.nested"]
    assert isinstance(nested, GGUFArray) and nested.tolist() == [[1, 2], [3]]
    config, params, tokenizer = load_gguf(path)
    assert (config.vocab_size, config.num_layers, config.tie_word_embeddings) == (
        gb.VOCAB, 1, True)
    assert tokenizer.decode(tokenizer("the theme")["input_ids"]) == "the theme"


def test_fuzz_corpus_ends_in_checkpoint_error_or_a_load(tmp_path: Path) -> None:
    cases = gb.corpus(SEED)
    assert len(cases) >= 300
    hostile = gb.tiny_gguf(gb.metadata() + [("kvpage.test.hostile", gb.ARRAY,
                                             gb.hostile_numbers())])
    cases.append(gb.Case("a 32 MiB UINT16 array nobody reads", gb.join(hostile)))
    del hostile
    outcomes: dict[str, int] = {"loaded": 0, "CheckpointError": 0}
    escaped, slow = [], []
    path = tmp_path / "case.gguf"
    tracemalloc.start()
    cpu = time.process_time()
    try:
        for case in cases:
            path.write_bytes(case.data)
            start = time.perf_counter()
            try:
                load_gguf(path)
                outcomes["loaded"] += 1
            except CheckpointError:
                outcomes["CheckpointError"] += 1
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:  # noqa: B036  (what the corpus is looking for)
                escaped.append(f"{case.name}: {type(exc).__name__}: {exc}")
            if time.perf_counter() - start > CASE_SECONDS:
                slow.append(case.name)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    cpu = time.process_time() - cpu
    assert not escaped, "\n".join(escaped)
    assert not slow, slow
    assert outcomes["loaded"] >= 10 and outcomes["CheckpointError"] >= 250, outcomes
    assert cpu < CORPUS_CPU_SECONDS, f"{len(cases)} cases took {cpu:.1f} s of CPU"
    assert peak < CORPUS_PEAK_BYTES, f"the corpus peaked at {peak >> 20} MiB"


# ---------------------------------------------------------------- alignment


@pytest.mark.parametrize(("kind", "value"), [
    (gb.U32, 0), (gb.I32, -32), (gb.I32, -1), (gb.U32, 48), (gb.U32, 31), (gb.U32, 3),
    (gb.U32, 1 << 25), (gb.U64, 1 << 40), (gb.F32, 32.0), (gb.STRING, "32"),
])
def test_bad_alignment_is_named(chunks: list[gb.Chunk], tmp_path: Path, kind: int,
                                value: Any) -> None:
    """Alignment 0 was a ZeroDivisionError; negative and non-power-of-two ones loaded."""
    data = gb.retyped(chunks, alignment_label(chunks), kind, value)
    path = write(tmp_path, data)
    with pytest.raises(CheckpointError, match=r"'general\.alignment'.*alignment"):
        GGUFFile(path)
    with pytest.raises(CheckpointError, match=r"case\.gguf.*alignment"):
        load_gguf(path)


def test_a_smaller_power_of_two_alignment_still_loads(chunks: list[gb.Chunk],
                                                      tmp_path: Path) -> None:
    """The same tensors with ``general.alignment = 16`` and the header padded to 16."""
    scalar = f"{alignment_label(chunks)}.scalar"
    header = len(gb.join(chunks[: [c.label for c in chunks].index("pad.header")]))
    realigned = [
        gb.Chunk(c.label, gb.u32(16)) if c.label == scalar
        else gb.Chunk(c.label, bytes(-header % 16)) if c.label == "pad.header" else c
        for c in chunks
    ]
    base = GGUFFile(write(tmp_path, gb.join(chunks), "base.gguf"))
    reader = GGUFFile(write(tmp_path, gb.join(realigned)))
    assert reader.alignment == 16
    for mine, ref in zip(reader.tensors, base.tensors, strict=True):
        assert mine.data_offset % 16 == 0 and np.array_equal(mine.data, ref.data)
    load_gguf(tmp_path / "case.gguf")


# ---------------------------------------------------------------- arrays


def test_arrays_nested_500_deep_in_a_small_file(tmp_path: Path) -> None:
    """Was a RecursionError (a raw traceback) from a 6 KB file."""
    data = gb.raw_kv_file("kvpage.deep", gb.ARRAY, gb.nested(500))
    assert len(data) < 7000
    path = write(tmp_path, data)
    with pytest.raises(CheckpointError, match=f"'kvpage.deep'.*nest more than {MAX_ARRAY_DEPTH}"):
        GGUFFile(path)
    with pytest.raises(CheckpointError, match="nest more than"):
        load_gguf(path)


def test_nesting_up_to_the_bound_is_read(tmp_path: Path) -> None:
    data = gb.raw_kv_file("kvpage.deep", gb.ARRAY, gb.nested(MAX_ARRAY_DEPTH))
    reader = GGUFFile(write(tmp_path, data))
    value: Any = reader.fields["kvpage.deep"].tolist()
    for _ in range(MAX_ARRAY_DEPTH - 1):
        (value,) = value
    assert value == [7]


@pytest.mark.parametrize("case", [
    "u8 count 2**62", "string count 2**64-1", "array count 2**40", "one string missing",
])
def test_declared_lengths_are_checked_before_allocating(tmp_path: Path, case: str) -> None:
    """Each length is checked against the bytes left before anything is read or
    allocated: a file declaring 400k strings with one missing used to decode them first."""
    if case == "one string missing":
        value: Any = gb.hostile_strings(STRINGS_BYTES, extra=1)
    else:
        element, count = {"u8 count 2**62": (gb.U8, 1 << 62),
                          "string count 2**64-1": (gb.STRING, (1 << 64) - 1),
                          "array count 2**40": (gb.ARRAY, 1 << 40)}[case]
        value = gb.RawArray(element, count, bytes(64))
    path = write(tmp_path, gb.kv_file([("kvpage.big", gb.ARRAY, value)]))
    error, peak = traced_peak(lambda: GGUFFile(path))
    assert isinstance(error, CheckpointError), error
    assert "'kvpage.big'" in str(error) and "truncated" in str(error)
    assert peak < 1 << 20, f"{peak >> 20} MiB allocated before the length was checked"


@pytest.mark.parametrize("key", ["kvpage.test.hostile", "tokenizer.ggml.token_type"])
@pytest.mark.parametrize("array", ["numbers", "strings"])
def test_a_hostile_32_mib_array_costs_bounded_memory(tmp_path: Path, key: str,
                                                     array: str) -> None:
    """A 32 MiB array used to become a Python list at parse time (786 MiB of RSS). Now
    one nobody reads is never decoded, and the tokenizer's are checked first."""
    value = gb.hostile_numbers() if array == "numbers" else gb.hostile_strings(STRINGS_BYTES)
    fields = [f for f in gb.metadata() if f[0] != key] + [(key, gb.ARRAY, value)]
    path = write(tmp_path, gb.join(gb.tiny_gguf(fields)))
    del value, fields
    result, peak = traced_peak(lambda: load_gguf(path))
    assert peak < HOSTILE_PEAK_BYTES, f"loading peaked at {peak >> 20} MiB"
    if key == "tokenizer.ggml.token_type":
        assert isinstance(result, CheckpointError)
        assert "'tokenizer.ggml.token_type'" in str(result)
        assert "one number for each of the 262 tokens" in str(result)
    else:
        assert not isinstance(result, CheckpointError), result
        assert result.config.vocab_size == gb.VOCAB


# ---------------------------------------------------------------- tensor infos


def with_tensor_field(chunks: list[gb.Chunk], tensor: int, part: str, data: bytes) -> bytes:
    return gb.replace(chunks, f"ti{tensor}.{part}", data)


@pytest.mark.parametrize(("case", "match"), [
    ("all at offset 0", r"overlap those of tensor"),
    ("overlapping", r"overlap those of tensor"),
    ("misaligned offset", r"offset \d+ is not a multiple of the alignment 32"),
    ("past the end", r"run past the end of the file .*truncated"),
    ("offset 2**64-32", r"run past the end of the file"),
    ("dim 0", r"a dim is 0"),
    ("dims overflow", r"more than 2\*\*63 - 1"),
    ("5 dims", r"5 dims, more than 4"),
    ("unknown type", r"unknown ggml type 200"),
    ("first dim not whole blocks", r"type Q8_0 stores blocks of 32 values"),
    ("duplicate name", r"appears twice"),
    ("2**40 tensors", r"declares 1099511627776 tensors"),
    ("2**40 keys", r"declares 1099511627776 keys"),
    ("duplicate key", r"'general.name'.*appears twice"),
])
def test_malformed_tensor_index_is_named(chunks: list[gb.Chunk], tmp_path: Path, case: str,
                                         match: str) -> None:
    """Tensors sharing or overlapping bytes, misaligned, past the end of the file, of
    absurd shapes or types, and counts the file cannot hold were loaded or crashed."""
    size = len(gb.join(chunks))
    offsets = [struct.unpack("<Q", c.data)[0] for c in chunks
               if c.label.startswith("ti") and c.label.endswith(".offset")]
    q8_0 = next(i for i, (_, kind) in enumerate(gb.TENSORS.values()) if kind == "Q8_0")
    mutate: dict[str, Callable[[], bytes]] = {
        "all at offset 0": lambda: gb.with_offsets(chunks, lambda i, off: 0),
        "overlapping": lambda: gb.with_offsets(chunks,
                                               lambda i, off: max(0, off - 32 * (i > 0))),
        "misaligned offset": lambda: with_tensor_field(chunks, 1, "offset",
                                                       gb.u64(offsets[1] + 4)),
        "past the end": lambda: with_tensor_field(chunks, 2, "offset", gb.u64(size)),
        "offset 2**64-32": lambda: with_tensor_field(chunks, 2, "offset", gb.u64(-32)),
        "dim 0": lambda: with_tensor_field(chunks, 3, "dim1", gb.u64(0)),
        "dims overflow": lambda: gb.replace(chunks, "ti2.dim1", gb.u64(1 << 62)),
        "5 dims": lambda: with_tensor_field(chunks, 1, "n_dims", gb.u32(5)),
        "unknown type": lambda: with_tensor_field(chunks, 1, "type", gb.u32(200)),
        "first dim not whole blocks": lambda: with_tensor_field(chunks, q8_0, "dim0",
                                                                gb.u64(16)),
        "duplicate name": lambda: _duplicate_tensor_name(chunks),
        "2**40 tensors": lambda: gb.replace(chunks, "header.n_tensors", gb.u64(1 << 40)),
        "2**40 keys": lambda: gb.replace(chunks, "header.n_kv", gb.u64(1 << 40)),
        "duplicate key": lambda: _duplicate_key(chunks),
    }
    path = write(tmp_path, mutate[case]())
    with pytest.raises(CheckpointError, match=match):
        GGUFFile(path)
    with pytest.raises(CheckpointError, match=r"case\.gguf"):
        load_gguf(path)


def _duplicate_tensor_name(chunks: list[gb.Chunk]) -> bytes:
    """ffn_norm (tensor 6) renamed to ffn_gate (tensor 7), a name of the same length."""
    names = list(gb.TENSORS)
    assert len(names[6]) == len(names[7])
    return gb.replace(chunks, "ti6.name", names[7].encode())


def _duplicate_key(chunks: list[gb.Chunk]) -> bytes:
    """The base file with a second ``general.name`` (which used to replace the first)."""
    return gb.join(gb.tiny_gguf([*gb.metadata(), ("general.name", gb.STRING, "twice")]))


# ---------------------------------------------------------------- the safety net


@pytest.mark.parametrize("error", [
    IndexError("index out of range"), struct.error("unpack_from requires a buffer"),
    OverflowError("int too large"), MemoryError(), KeyError("k"), TypeError("bad operand"),
    ZeroDivisionError("division by zero"), RecursionError("maximum recursion depth"),
    UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"), ValueError("bad"),
])
def test_any_other_parse_error_becomes_a_checkpoint_error(
    chunks: list[gb.Chunk], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    error: Exception,
) -> None:
    """Whatever the parse trips on that its checks missed is still a CheckpointError
    naming the file, the key being read, the offset and the original error."""
    path = write(tmp_path, gb.join(chunks))

    def value(self: Any, kind: int, key: str) -> Any:
        if key == "llama.block_count":
            raise error
        return original(self, kind, key)

    original = gguf_file_module._Reader.value
    monkeypatch.setattr(gguf_file_module._Reader, "value", value)
    with pytest.raises(CheckpointError,
                       match=rf"case\.gguf: key #\d+ 'llama.block_count', at byte \d+: "
                             rf"{type(error).__name__}"):
        load_gguf(path)
