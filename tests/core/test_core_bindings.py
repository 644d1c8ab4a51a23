"""Property and behaviour tests of the Rust core through its Python bindings.

``kvpage._core`` exposes ``BlockPool``, ``KVCacheManager`` and ``KVPageError``.
These tests drive them the way a model runner does and check, from Python only:

1. a hypothesis state machine over ``KVCacheManager`` that keeps a simulated
   device KV store (copy-on-write orders applied block by block, new tokens
   written at their slots) and checks after every step that each live sequence
   reads back exactly its own tokens, plus the block accounting, salt isolation,
   all-or-nothing allocation and the prefix-cache counters;
2. error behaviour: typed exceptions (``KVPageError`` / ``ValueError``) naming
   the offending value, never a crash, and a failed call changes nothing;
3. concrete scenarios from the design notes (slot arithmetic, fork sharing,
   prefix-cache sharing, LRU eviction, numpy return types).

Core bugs these tests once found are pinned by tests that state the
correct behaviour, so they fail if a bug returns.
``tests/core_model.py`` mirrors the one core
internal the API cannot show (the block hash), to build a hash collision.

Hypothesis runs derandomized with no example database, so CI is reproducible.
Set ``KVPAGE_HYPOTHESIS_SCALE=10`` (say) for a longer local run.
"""

import collections
import dataclasses
import os
import pickle
import re
from collections.abc import Callable, Sequence
from typing import Any

import kvpage
import numpy as np
import numpy.typing as npt
import pytest
from core_model import colliding_block
from hypothesis import HealthCheck, given, settings
from hypothesis import event as hypothesis_event
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from kvpage._core import BlockPool, KVCacheManager, KVPageError

settings.register_profile(
    "kvpage-ci",
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
CI = settings.get_profile("kvpage-ci")
SCALE = max(1, int(os.environ.get("KVPAGE_HYPOTHESIS_SCALE", "1")))

U32_MAX = 2**32 - 1
USIZE_MAX = 2**64 - 1

IntArray = npt.NDArray[np.int64]
TokenFormat = Callable[[Sequence[int]], Any]

# Containers extract_tokens accepts: the three numpy fast paths (contiguous or
# strided) and the generic sequence path.
TOKEN_FORMATS: list[TokenFormat] = [
    list,
    tuple,
    lambda t: np.asarray(t, dtype=np.int32),
    lambda t: np.asarray(t, dtype=np.int64),
    lambda t: np.asarray(t, dtype=np.uint32),
    lambda t: np.repeat(np.asarray(t, dtype=np.int64), 2)[::2],  # strided view
    lambda t: np.asarray(t, dtype=">i4"),  # non-native byte order: generic path
]

# Prompts start with a piece of one of these, so whole blocks repeat across
# sequences even at block size 8 and the prefix cache gets hits.
BASE_PROMPTS: list[list[int]] = [
    [0] * 32,
    [i % 3 for i in range(32)],
    [1, 2] * 16,
]


def mentions(value: int) -> str:
    """A regex matching `value` as a whole number inside an error message."""
    return rf"(?<![\d-]){re.escape(str(value))}(?!\d)"


def assert_int32_array(array: object, ndim: int) -> None:
    assert isinstance(array, np.ndarray), f"expected a numpy array, got {type(array)}"
    assert array.dtype == np.int32, array.dtype
    assert array.ndim == ndim, array.shape


def all_refcounts(kv: KVCacheManager) -> list[int]:
    return [kv.refcount(b) for b in range(kv.num_blocks)]


def manager_snapshot(kv: KVCacheManager, seqs: Sequence[int]) -> tuple[object, ...]:
    """Everything the API shows about `kv` and the sequences `seqs`."""
    tables = tuple((kv.num_tokens(s), tuple(kv.block_table(s).tolist())) for s in seqs)
    return (
        kv.num_sequences,
        kv.num_free_blocks,
        kv.num_available_blocks,
        kv.num_cached_blocks,
        tuple(all_refcounts(kv)),
        tuple(sorted(kv.prefix_cache_stats().items())),
        tables,
    )


class PanicGuard:
    """Forwards to a core object, turning a Rust panic into an AssertionError.

    pyo3's PanicException derives from BaseException, which hypothesis does not
    treat as a test failure: it would propagate without shrinking and without
    printing the falsifying steps. Behind this guard a panic is an ordinary
    failure, so hypothesis shrinks it to a minimal call sequence.
    """

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        if not callable(value):
            return value

        def guarded(*args: Any, **kwargs: Any) -> Any:
            try:
                return value(*args, **kwargs)
            except BaseException as err:
                if type(err).__name__ != "PanicException":
                    raise
                raise AssertionError(f"Rust panic in {name}{args}: {err}") from err

        return guarded


def guarded_manager(num_blocks: int, block_size: int, caching: bool) -> KVCacheManager:
    """A KVCacheManager behind a PanicGuard (typed as the manager it wraps)."""
    manager: Any = PanicGuard(KVCacheManager(num_blocks, block_size, caching))
    return manager


# --------------------------------------------------------------------------
# 1. State machine over KVCacheManager with a simulated device KV store.
# --------------------------------------------------------------------------

# What the state machine exercised, over a whole hypothesis run; a test
# asserts every entry happened, so the machine cannot silently stop covering.
COVERAGE: collections.Counter[str] = collections.Counter()


def event(name: str) -> None:
    COVERAGE[name] += 1
    hypothesis_event(name)


# (salt, index into BASE_PROMPTS, length of the shared head (capped at three
#  blocks), own tail, leave the last token out of the prefix query, look the
#  prefix up at all (two equal requests in one step both miss), token container)
PromptSpec = tuple[str | None, int, int, list[int], bool, bool, TokenFormat]


def prompt_specs() -> st.SearchStrategy[PromptSpec]:
    return st.tuples(
        st.sampled_from([None, "a", "b"]),
        st.integers(0, len(BASE_PROMPTS) - 1),
        st.integers(0, 24),
        st.lists(st.integers(0, 3), min_size=1, max_size=6),
        st.booleans(),
        st.sampled_from([True, True, True, False]),
        st.sampled_from(TOKEN_FORMATS),
    )


@dataclasses.dataclass
class SeqModel:
    """What the test knows about one live sequence."""

    tokens: list[int]
    salt: str | None
    epoch: int
    # Leading blocks registered on this sequence's prefix-tree path (it holds
    # the whole path, so none of it can be evicted while it lives).
    cached_blocks: int


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv: KVCacheManager | None = None
        self.seqs: dict[int, SeqModel] = {}

    # -- setup -------------------------------------------------------------

    @initialize(
        num_blocks=st.integers(1, 32),
        block_size=st.integers(1, 8),
        caching=st.booleans(),
        prompts=st.lists(prompt_specs(), min_size=1, max_size=4),
    )
    def setup(
        self, num_blocks: int, block_size: int, caching: bool, prompts: list[PromptSpec]
    ) -> None:
        self.kv = guarded_manager(num_blocks, block_size, caching)
        self.nb = num_blocks
        self.bs = block_size
        self.caching = caching
        # Distinct garbage in every slot, far from any token id: reading an
        # unwritten or wrongly copied slot can never look like a right answer.
        self.device: IntArray = np.arange(num_blocks * block_size, dtype=np.int64) + 10**9
        self.epoch = 0
        # Every whole-block token prefix cached per salt since the last reset:
        # a superset of what the prefix tree may hold.
        self.cached_paths: dict[str | None, set[tuple[int, ...]]] = {}
        self.inserted = 0
        self.cleared = 0
        self.queries = 0
        self.query_tokens = 0
        self.hit_blocks = 0
        assert kv_of(self).num_blocks == num_blocks and kv_of(self).block_size == block_size
        # Start with live sequences: hypothesis' swarm testing disables a random
        # subset of rules per run, and a run without `create` should still work.
        for spec in prompts:
            self.create(spec, keep_on_failure=True)

    # -- helpers -----------------------------------------------------------

    def active(self, model: SeqModel) -> bool:
        """Whether the core still registers this sequence's blocks."""
        return self.caching and model.epoch == self.epoch

    def min_expected_match(self, salt: str | None, query: Sequence[int]) -> int:
        """Blocks of `query` that a live sequence of the same salt holds cached."""
        best = 0
        bs = self.bs
        for model in self.seqs.values():
            if model.salt != salt or not self.active(model):
                continue
            limit = min(model.cached_blocks, len(query) // bs)
            j = 0
            while (
                j < limit
                and list(query[j * bs : (j + 1) * bs]) == model.tokens[j * bs : (j + 1) * bs]
            ):
                j += 1
            best = max(best, j)
        return best

    def record_cached(self, model: SeqModel, upto_blocks: int) -> None:
        paths = self.cached_paths.setdefault(model.salt, set())
        for j in range(model.cached_blocks + 1, upto_blocks + 1):
            paths.add(tuple(model.tokens[: j * self.bs]))
        model.cached_blocks = max(model.cached_blocks, upto_blocks)

    def cache(self, seq: int, length: int, fmt: TokenFormat) -> None:
        kv = kv_of(self)
        model = self.seqs[seq]
        newly = kv.cache_blocks(seq, fmt(model.tokens[:length]))
        full = min(length, len(model.tokens)) // self.bs
        assert 0 <= newly <= max(0, full - model.cached_blocks)
        if not self.active(model):
            assert newly == 0, "a sequence that cannot cache inserted blocks"
        else:
            self.record_cached(model, full)
        self.inserted += newly

    def grow(self, seq: int, new: list[int], fmt: TokenFormat, cache: bool) -> bool:
        """Reserve slots for `new`, run the copies, write the tokens; as a runner."""
        kv = kv_of(self)
        bs = self.bs
        model = self.seqs[seq]
        start = kv.num_tokens(seq)
        assert start == len(model.tokens)
        table = kv.block_table(seq).tolist()
        needed = kv.blocks_needed(seq, len(new))
        expect_copy = bool(new) and start % bs != 0 and kv.refcount(table[-1]) > 1
        before = manager_snapshot(kv, [seq])
        available = kv.num_available_blocks

        evicted_before = kv.prefix_cache_stats()["evicted_blocks"]
        copies = kv.allocate_slots(seq, len(new))
        if copies is None:
            event("allocation refused")
            if kv.num_available_blocks > kv.num_free_blocks:
                event("allocation refused with evictable blocks")
            assert needed > available, f"refused {needed} blocks with {available} available"
            assert manager_snapshot(kv, [seq]) == before, "a failed allocation changed state"
            return False
        assert needed <= available
        if kv.prefix_cache_stats()["evicted_blocks"] > evicted_before:
            event("evicted to allocate")
        assert_int32_array(copies, 2)
        assert copies.shape == (int(expect_copy), 2)
        assert kv.num_available_blocks == available - needed
        new_table = kv.block_table(seq).tolist()
        assert len(new_table) == -(-(start + len(new)) // bs)
        if expect_copy:
            event("copy-on-write")
            src, dst = copies[0].tolist()
            assert src == table[-1] and dst == new_table[len(table) - 1] and src != dst
            assert new_table[: len(table) - 1] == table[:-1], "only the last block is copied"
        else:
            assert new_table[: len(table)] == table
        assert len(set(new_table)) == len(new_table)

        for src, dst in copies.tolist():
            self.device[dst * bs : (dst + 1) * bs] = self.device[src * bs : (src + 1) * bs]
        slots = kv.slot_mapping(seq, start, len(new))
        assert_int32_array(slots, 1)
        self.device[slots] = new
        model.tokens.extend(new)
        if cache:
            self.cache(seq, len(model.tokens), fmt)
        return True

    def free(self, seq: int) -> None:
        kv = kv_of(self)
        table = kv.block_table(seq).tolist()
        sole = sum(1 for b in table if kv.refcount(b) == 1)
        available, free = kv.num_available_blocks, kv.num_free_blocks
        kv.free_sequence(seq)
        del self.seqs[seq]
        if self.caching:
            # Pins (not visible here) may come back too.
            assert kv.num_available_blocks >= available + sole
        else:
            assert kv.num_available_blocks == available + sole
            assert kv.num_free_blocks == free + sole
        with pytest.raises(KVPageError, match=mentions(seq)):
            kv.num_tokens(seq)

    # -- rules -------------------------------------------------------------

    @rule(spec=prompt_specs(), keep_on_failure=st.booleans())
    def create(self, spec: PromptSpec, keep_on_failure: bool) -> None:
        """A request arrives: reuse its cached prefix, allocate and write the rest."""
        salt, base, head, tail, drop_last, lookup, fmt = spec
        prompt = BASE_PROMPTS[base][: min(head, 3 * self.bs)] + tail[: self.bs + 1]
        self.admit(salt, prompt, drop_last, lookup, fmt, keep_on_failure)

    @precondition(
        lambda self: self.kv is not None and self.kv.num_available_blocks > self.kv.num_free_blocks
    )
    @rule(
        salt=st.sampled_from([None, "a", "b"]),
        seed=st.integers(0, 3),
        extra=st.integers(1, 4),
        fmt=st.sampled_from(TOKEN_FORMATS),
    )
    def create_long(self, salt: str | None, seed: int, extra: int, fmt: TokenFormat) -> None:
        """A prompt that fits only by evicting cached-unreferenced blocks (or,
        one block more, does not fit at all)."""
        kv = kv_of(self)
        evictable = kv.num_available_blocks - kv.num_free_blocks
        num_blocks = kv.num_free_blocks + min(evictable + 1, extra)
        prompt = [100 + seed + i % 5 for i in range(num_blocks * self.bs)]
        self.admit(salt, prompt, False, True, fmt, keep_on_failure=False)

    def admit(
        self,
        salt: str | None,
        prompt: list[int],
        drop_last: bool,
        lookup: bool,
        fmt: TokenFormat,
        keep_on_failure: bool,
    ) -> None:
        kv = kv_of(self)
        bs = self.bs
        query = prompt[:-1] if drop_last else prompt

        seq = kv.create_sequence(salt)
        assert seq not in self.seqs
        expected_min = self.min_expected_match(salt, query)
        matched = kv.match_prefix(seq, fmt(query)) if lookup else 0
        assert matched % bs == 0 and matched <= len(query) // bs * bs
        if self.caching and lookup:
            self.queries += 1
            self.query_tokens += len(query)
            self.hit_blocks += matched // bs
            assert matched // bs >= expected_min, "a held cached prefix was not matched"
            if matched:
                event("prefix hit")
                paths = self.cached_paths.get(salt, set())
                assert tuple(query[:matched]) in paths, "matched tokens that were never cached"
        else:
            assert matched == 0
        assert kv.num_tokens(seq) == matched
        assert len(kv.block_table(seq)) == matched // bs
        self.seqs[seq] = SeqModel(
            tokens=list(query[:matched]), salt=salt, epoch=self.epoch, cached_blocks=matched // bs
        )
        if not self.grow(seq, prompt[matched:], fmt, cache=True) and not keep_on_failure:
            self.free(seq)

    @precondition(lambda self: bool(self.seqs))
    @rule(
        data=st.data(),
        n=st.integers(0, 10),
        cache=st.sampled_from([True, True, True, False]),
        fmt=st.sampled_from(TOKEN_FORMATS),
    )
    def append(self, data: st.DataObject, n: int, cache: bool, fmt: TokenFormat) -> None:
        seq = data.draw(st.sampled_from(sorted(self.seqs)), label="seq")
        n = min(n, self.bs + 2)
        new = data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n), label="new")
        self.grow(seq, new, fmt, cache)

    @precondition(lambda self: bool(self.seqs))
    @rule(data=st.data(), fmt=st.sampled_from(TOKEN_FORMATS))
    def cache_prefix(self, data: st.DataObject, fmt: TokenFormat) -> None:
        """Register blocks late (e.g. after a fork), possibly only a prefix."""
        seq = data.draw(st.sampled_from(sorted(self.seqs)), label="seq")
        length = data.draw(st.integers(0, len(self.seqs[seq].tokens) + 2), label="length")
        self.cache(seq, length, fmt)

    @precondition(lambda self: bool(self.seqs))
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        self.fork_seq(data.draw(st.sampled_from(sorted(self.seqs)), label="seq"))

    @precondition(lambda self: bool(self.seqs))
    @rule(data=st.data(), n=st.integers(1, 3), fmt=st.sampled_from(TOKEN_FORMATS))
    def parallel_sample(self, data: st.DataObject, n: int, fmt: TokenFormat) -> None:
        """Fork and write the child's first tokens at once (copy-on-write)."""
        child = self.fork_seq(data.draw(st.sampled_from(sorted(self.seqs)), label="seq"))
        new = data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n), label="new")
        self.grow(child, new, fmt, cache=True)

    @precondition(lambda self: bool(self.seqs))
    @rule(data=st.data(), fmt=st.sampled_from(TOKEN_FORMATS))
    def duplicate_request(self, data: st.DataObject, fmt: TokenFormat) -> None:
        """An equal request computed without a lookup (both arrived in one step):
        its blocks duplicate cached ones, so the core pins the cached blocks."""
        model = self.seqs[data.draw(st.sampled_from(sorted(self.seqs)), label="seq")]
        prompt = list(model.tokens) or [0]
        self.admit(model.salt, prompt, False, False, fmt, keep_on_failure=False)

    def fork_seq(self, seq: int) -> int:
        kv = kv_of(self)
        table = kv.block_table(seq).tolist()
        refs = all_refcounts(kv)
        available, free = kv.num_available_blocks, kv.num_free_blocks
        child = kv.fork(seq)
        assert child != seq and child not in self.seqs
        assert kv.block_table(child).tolist() == table
        assert kv.num_tokens(child) == kv.num_tokens(seq)
        assert (kv.num_available_blocks, kv.num_free_blocks) == (available, free)
        for b in table:
            if self.caching:
                assert kv.refcount(b) > refs[b]
            else:
                assert kv.refcount(b) == refs[b] + 1
        if kv.num_tokens(seq) % self.bs:
            event("fork sharing a partial block")
        parent = self.seqs[seq]
        self.seqs[child] = dataclasses.replace(parent, tokens=list(parent.tokens))
        return child

    @precondition(lambda self: bool(self.seqs))
    @rule(data=st.data())
    def free_sequence(self, data: st.DataObject) -> None:
        self.free(data.draw(st.sampled_from(sorted(self.seqs)), label="seq"))

    @precondition(lambda self: bool(self.seqs))
    @rule()
    def finish_oldest(self) -> None:
        """The oldest request completes (a second way to free: frees are common)."""
        self.free(min(self.seqs))

    @precondition(
        lambda self: self.kv is not None and self.kv.num_available_blocks > self.kv.num_free_blocks
    )
    @rule(count=st.integers(1, 4))  # evict(0) is covered by the random-call test
    def evict(self, count: int) -> None:
        kv = kv_of(self)
        free, available, cached = kv.num_free_blocks, kv.num_available_blocks, kv.num_cached_blocks
        evicted = kv.evict(count)
        if evicted:
            event("evicted")
        assert evicted == min(count, available - free)
        assert kv.num_free_blocks == free + evicted
        assert kv.num_available_blocks == available
        assert kv.num_cached_blocks == cached - evicted

    @rule()
    def reset_prefix_cache(self) -> None:
        kv = kv_of(self)
        available = kv.num_available_blocks
        self.cleared += kv.num_cached_blocks
        if kv.num_cached_blocks and self.seqs:
            event("reset with cached blocks and live sequences")
        kv.reset_prefix_cache()
        assert kv.num_cached_blocks == 0
        assert kv.num_free_blocks == kv.num_available_blocks == available
        self.epoch += 1
        self.cached_paths.clear()

    # -- invariants --------------------------------------------------------

    @invariant()
    def consistent(self) -> None:
        if self.kv is None:
            return
        kv = self.kv
        bs, nb = self.bs, self.nb
        kv.check_invariants()
        assert kv.num_sequences == len(self.seqs)

        holders = [0] * nb
        where: dict[int, list[tuple[int, int]]] = {}
        salts: dict[int, set[str | None]] = {}
        for seq, model in self.seqs.items():
            n = len(model.tokens)
            assert kv.num_tokens(seq) == n
            table = kv.block_table(seq)
            assert_int32_array(table, 1)
            assert len(table) == -(-n // bs)
            slots = kv.slot_mapping(seq, 0, n)
            assert_int32_array(slots, 1)
            assert np.all((slots >= 0) & (slots < nb * bs))
            read = self.device[slots].tolist()
            assert read == model.tokens, f"sequence {seq} reads {read}, wrote {model.tokens}"
            for i, b in enumerate(table.tolist()):
                holders[b] += 1
                where.setdefault(b, []).append((seq, i))
                salts.setdefault(b, set()).add(model.salt)

        refs = all_refcounts(kv)
        referenced = sum(1 for r in refs if r > 0)
        free, available = kv.num_free_blocks, kv.num_available_blocks
        cached_unreferenced = available - free
        assert free + referenced + cached_unreferenced == nb
        assert kv.num_referenced_blocks == referenced
        assert 0 <= cached_unreferenced <= kv.num_cached_blocks
        assert kv.usage == pytest.approx(referenced / nb)
        for b in range(nb):
            if self.caching:
                assert refs[b] >= holders[b], f"block {b}: refcount {refs[b]} < {holders[b]}"
                if refs[b] > holders[b] > 0:
                    event("block in a table is also pinned")
            else:
                assert refs[b] == holders[b], f"block {b}: refcount {refs[b]} != {holders[b]}"
        if not self.caching:
            assert kv.num_cached_blocks == 0 and cached_unreferenced == 0

        for b, salt_set in salts.items():
            assert len(salt_set) == 1, f"block {b} shared across salts {salt_set}"
        # A block that will be written (a partial last block) is shared only
        # between forks that have not written it yet: all hold it as partial last.
        for seq, model in self.seqs.items():
            n = len(model.tokens)
            if n % bs == 0:
                continue
            last = kv.block_table(seq).tolist()[-1]
            for other, index in where[last]:
                other_n = len(self.seqs[other].tokens)
                assert index == (other_n - 1) // bs and other_n % bs != 0, (
                    f"partial block {last} of {seq} is block {index} of {other}"
                )

        stats = kv.prefix_cache_stats()
        assert stats["inserted_blocks"] == self.inserted
        assert stats["queries"] == self.queries
        assert stats["query_tokens"] == self.query_tokens
        assert stats["hit_blocks"] == self.hit_blocks
        assert stats["hit_tokens"] == self.hit_blocks * bs
        assert kv.num_cached_blocks == self.inserted - stats["evicted_blocks"] - self.cleared

    def teardown(self) -> None:
        if self.kv is None:
            return
        kv = self.kv
        for seq in sorted(self.seqs):
            kv.free_sequence(seq)
        self.seqs.clear()
        kv.check_invariants()
        assert kv.num_sequences == 0
        assert kv.num_referenced_blocks == 0
        assert kv.num_available_blocks == kv.num_blocks
        kv.reset_prefix_cache()
        assert kv.num_free_blocks == kv.num_blocks


def kv_of(machine: KVCacheMachine) -> KVCacheManager:
    assert machine.kv is not None
    return machine.kv


def test_kv_cache_manager_state_machine() -> None:
    COVERAGE.clear()
    run_state_machine_as_test(
        KVCacheMachine,
        settings=settings(CI, max_examples=150 * SCALE, stateful_step_count=50),
    )
    expected = {
        "allocation refused",
        "allocation refused with evictable blocks",
        "copy-on-write",
        "fork sharing a partial block",
        "prefix hit",
        "evicted",
        "evicted to allocate",
        "block in a table is also pinned",
        "reset with cached blocks and live sequences",
    }
    missing = expected - set(COVERAGE)
    assert not missing, f"the state machine never exercised {sorted(missing)}: {COVERAGE}"


# --------------------------------------------------------------------------
# 2. Error behaviour.
# --------------------------------------------------------------------------


def test_block_pool_double_free_names_the_block() -> None:
    pool = BlockPool(4, 16)
    (block,) = pool.allocate(1).tolist()
    pool.free(block)
    with pytest.raises(KVPageError, match=rf"{mentions(block)}.*double free"):
        pool.free(block)
    with pytest.raises(KVPageError, match=mentions(block)):
        pool.retain(block)
    pool.check_invariants()
    assert pool.num_free == 4


@pytest.mark.parametrize("block", [4, 5, 1000, 2**31, 2**40])
def test_block_pool_out_of_range_block_names_the_block(block: int) -> None:
    pool = BlockPool(4, 16)
    pool.allocate(2)
    for call in (pool.free, pool.retain, pool.refcount):
        with pytest.raises((KVPageError, ValueError), match=mentions(block)):
            call(block)
    pool.check_invariants()
    assert pool.num_free == 2


@pytest.mark.parametrize("block", [-1, -7, -(2**40)])
def test_block_pool_negative_block_is_a_value_error(block: int) -> None:
    pool = BlockPool(4, 16)
    pool.allocate(4)
    for call in (pool.free, pool.retain, pool.refcount):
        with pytest.raises(ValueError, match=mentions(block)):
            call(block)
    pool.check_invariants()
    assert pool.num_free == 0


@pytest.mark.parametrize(
    ("num_blocks", "block_size", "named"),
    [(0, 16, 0), (2**31 - 1, 16, 2**31 - 1), (4, 0, 0), (4, 65537, 65537)],
)
def test_constructors_reject_bad_sizes(num_blocks: int, block_size: int, named: int) -> None:
    """Empty pools, zero or huge blocks, and block ids beyond int32 are refused."""
    with pytest.raises(ValueError, match=mentions(named)):
        BlockPool(num_blocks, block_size)
    with pytest.raises(ValueError, match=mentions(named)):
        KVCacheManager(num_blocks, block_size)


pool_ops = st.lists(
    st.one_of(
        st.tuples(st.just("allocate"), st.integers(0, 6)),
        st.tuples(st.just("free"), st.integers(-3, 10)),
        st.tuples(st.just("retain"), st.integers(-3, 10)),
    ),
    min_size=5,
    max_size=80,
)


@settings(CI, max_examples=300 * SCALE)
@given(num_blocks=st.integers(1, 8), ops=pool_ops)
def test_block_pool_matches_lifo_refcount_model(
    num_blocks: int, ops: list[tuple[str, int]]
) -> None:
    """Valid and invalid calls against a LIFO free list + refcount model."""
    pool = BlockPool(num_blocks, 4)
    free_stack = list(range(num_blocks))[::-1]  # lowest id handed out first
    refcount = [0] * num_blocks
    for op, arg in ops:
        if op == "allocate":
            got = pool.allocate(arg)
            if arg > len(free_stack):
                assert got is None
            else:
                assert_int32_array(got, 1)
                expected = [free_stack.pop() for _ in range(arg)]
                assert got.tolist() == expected
                for b in expected:
                    refcount[b] = 1
        else:
            call = pool.free if op == "free" else pool.retain
            if arg < 0:
                with pytest.raises(ValueError, match=mentions(arg)):
                    call(arg)
            elif arg >= num_blocks or refcount[arg] == 0:
                with pytest.raises(KVPageError, match=mentions(arg)):
                    call(arg)
            elif op == "retain":
                call(arg)
                refcount[arg] += 1
            else:
                call(arg)
                refcount[arg] -= 1
                if refcount[arg] == 0:
                    free_stack.append(arg)
        pool.check_invariants()
        assert pool.num_free == len(free_stack)
        assert [pool.refcount(b) for b in range(num_blocks)] == refcount


def test_unknown_and_freed_sequence_handles_raise() -> None:
    kv = KVCacheManager(8, 4)
    live = kv.create_sequence()
    kv.allocate_slots(live, 5)
    dead = kv.create_sequence()
    kv.allocate_slots(dead, 3)
    kv.free_sequence(dead)
    reused = kv.create_sequence()  # takes dead's slot with a new generation
    assert reused != dead
    assert kv.num_tokens(reused) == 0
    never = (123 << 32) | 77
    stale_generation = live + (1 << 32)
    before = manager_snapshot(kv, [live, reused])
    calls: list[Callable[[int], object]] = [
        lambda s: kv.match_prefix(s, [1, 2, 3, 4]),
        lambda s: kv.blocks_needed(s, 1),
        lambda s: kv.allocate_slots(s, 1),
        lambda s: kv.slot_mapping(s, 0, 0),
        kv.block_table,
        kv.num_tokens,
        lambda s: kv.cache_blocks(s, [1, 2, 3, 4]),
        kv.fork,
        kv.free_sequence,
    ]
    for handle in (dead, never, stale_generation):
        for call in calls:
            with pytest.raises(KVPageError, match=rf"unknown sequence.*{mentions(handle)}"):
                call(handle)
    assert manager_snapshot(kv, [live, reused]) == before
    kv.check_invariants()


BAD_TOKENS: list[object] = [
    [-1],
    [1, 2, 2**32],
    np.array([3, -5], dtype=np.int32),
    np.array([2**32 + 1], dtype=np.int64),
    np.zeros((2, 2), dtype=np.int32),
    np.zeros((2, 1), dtype=np.int64),
    [1.5],
    "abc",
    [2**70],
    None,
]


@pytest.mark.parametrize("tokens", BAD_TOKENS, ids=lambda t: type(t).__name__)
def test_bad_token_containers_are_value_errors(tokens: object) -> None:
    kv = KVCacheManager(8, 4)
    seq = kv.create_sequence()
    kv.allocate_slots(seq, 4)
    empty = kv.create_sequence()
    before = manager_snapshot(kv, [seq, empty])
    with pytest.raises(ValueError):
        kv.match_prefix(empty, tokens)
    with pytest.raises(ValueError):
        kv.cache_blocks(seq, tokens)
    assert manager_snapshot(kv, [seq, empty]) == before
    kv.check_invariants()


@pytest.mark.parametrize("value", [-1, U32_MAX + 1, -(2**40)])
def test_out_of_range_token_id_is_named(value: int) -> None:
    kv = KVCacheManager(8, 4)
    seq = kv.create_sequence()
    with pytest.raises(ValueError, match=mentions(value)):
        kv.match_prefix(seq, [0, value])
    with pytest.raises(ValueError, match=mentions(value)):
        kv.match_prefix(seq, np.array([value], dtype=np.int64))


def test_u32_max_token_is_accepted() -> None:
    kv = KVCacheManager(8, 2)
    seq = kv.create_sequence()
    kv.allocate_slots(seq, 2)
    assert kv.cache_blocks(seq, np.array([U32_MAX, 0], dtype=np.uint32)) == 1
    probe = kv.create_sequence()
    assert kv.match_prefix(probe, [U32_MAX, 0]) == 2


def test_match_prefix_on_non_empty_sequence_raises() -> None:
    kv = KVCacheManager(8, 4)
    seq = kv.create_sequence()
    kv.allocate_slots(seq, 3)
    before = manager_snapshot(kv, [seq])
    with pytest.raises(KVPageError, match=rf"{mentions(seq)}.*{mentions(3)} tokens"):
        kv.match_prefix(seq, [1, 2, 3, 4])
    assert manager_snapshot(kv, [seq]) == before


def test_slot_mapping_past_the_end_raises() -> None:
    kv = KVCacheManager(8, 4)
    seq = kv.create_sequence()
    kv.allocate_slots(seq, 5)
    assert kv.slot_mapping(seq, 5, 0).tolist() == []
    for start, n in [(5, 1), (0, 6), (6, 0), (100, 3)]:
        with pytest.raises(ValueError, match=mentions(5)):
            kv.slot_mapping(seq, start, n)


Op = tuple[str, int, int, int]
# Operations that take a sequence handle (and must reject an unknown one).
HANDLE_OPS = {
    "allocate",
    "allocate_huge",
    "slot_mapping",
    "block_table",
    "num_tokens",
    "blocks_needed",
    "match",
    "cache",
    "fork",
    "free",
}


def op_strategy() -> st.SearchStrategy[Op]:
    kinds = st.sampled_from(
        [
            "create",
            "allocate",
            "allocate_huge",
            "slot_mapping",
            "block_table",
            "num_tokens",
            "blocks_needed",
            "match",
            "match_bad",
            "cache",
            "cache_bad",
            "fork",
            "free",
            "evict",
            "refcount",
            "reset",
        ]
    )
    # (kind, handle pick, small int, another small int)
    return st.tuples(kinds, st.integers(0, 63), st.integers(-3, 40), st.integers(0, 40))


@settings(CI, max_examples=300 * SCALE)
@given(
    block_size=st.integers(1, 6),
    caching=st.booleans(),
    ops=st.lists(op_strategy(), min_size=5, max_size=60),
)
def test_random_call_sequences_never_crash_and_errors_change_nothing(
    block_size: int, caching: bool, ops: list[Op]
) -> None:
    """Valid and invalid calls mixed: every call returns or raises a typed
    error (a Rust panic is a BaseException and fails the test), a call that
    raises leaves the manager exactly as it was, and invariants always hold."""
    kv = guarded_manager(8, block_size, caching)
    live: list[int] = []
    dead: list[int] = []
    expected_errors = (KVPageError, ValueError, OverflowError, TypeError)
    for kind, pick, a, b in ops:
        handles = live + dead + [(5 << 32) | 3, 10**6]
        handle = handles[pick % len(handles)]
        known = handle in live
        before = manager_snapshot(kv, live)
        raised: BaseException | None = None
        try:
            if kind == "create":
                live.append(kv.create_sequence([None, "a", "b"][pick % 3]))
            elif kind == "allocate":
                result = kv.allocate_slots(handle, max(a, 0))
                assert result is None or result.shape[1] == 2
                assert result is not None or manager_snapshot(kv, live) == before
            elif kind == "allocate_huge":
                # Far beyond any pool, but not near the usize wrap-around.
                assert kv.allocate_slots(handle, 2**40 + a) is None
                assert manager_snapshot(kv, live) == before
            elif kind == "slot_mapping":
                n_tokens = kv.num_tokens(handle) if known else -1
                slots = kv.slot_mapping(handle, max(a, 0), b)
                assert known and max(a, 0) + b <= n_tokens and len(slots) == b
            elif kind == "block_table":
                kv.block_table(handle)
            elif kind == "num_tokens":
                kv.num_tokens(handle)
            elif kind == "blocks_needed":
                kv.blocks_needed(handle, max(a, 0))
            elif kind == "match":
                kv.match_prefix(handle, [t % 3 for t in range(b)])
            elif kind == "match_bad":
                kv.match_prefix(handle, BAD_TOKENS[pick % len(BAD_TOKENS)])
            elif kind == "cache":
                kv.cache_blocks(handle, [t % 3 for t in range(b)])
            elif kind == "cache_bad":
                kv.cache_blocks(handle, BAD_TOKENS[pick % len(BAD_TOKENS)])
            elif kind == "fork":
                live.append(kv.fork(handle))
            elif kind == "free":
                kv.free_sequence(handle)
                live.remove(handle)
                dead.append(handle)
            elif kind == "evict":
                kv.evict(a)
            elif kind == "refcount":
                kv.refcount(a * 3)
            elif kind == "reset":
                kv.reset_prefix_cache()
        except expected_errors as err:
            raised = err
        if raised is not None:
            assert manager_snapshot(kv, live) == before, f"{kind}: {raised!r} but changed state"
        if not known and kind in HANDLE_OPS:
            assert isinstance(raised, KVPageError), f"{kind} on unknown handle: {raised!r}"
        if kind in {"match_bad", "cache_bad"}:
            assert isinstance(raised, ValueError), f"{kind}: {raised!r}"
        if kind == "refcount":
            assert (raised is None) == (0 <= a * 3 < 8)
        kv.check_invariants()
        assert kv.num_sequences == len(live)
    for seq in live:
        kv.free_sequence(seq)
    kv.check_invariants()
    assert kv.num_referenced_blocks == 0


# Core bugs found by these tests, now fixed; each test pins the correct
# behaviour: huge counts are refused without wrapping, ranges are checked
# before memory is reserved, and KVPageError pickles.


def refuse_or_reject(kv: KVCacheManager, seq: int, num_new_tokens: int) -> None:
    """The acceptable answers to an impossible request: None or a ValueError."""
    try:
        result = kv.allocate_slots(seq, num_new_tokens)
    except (ValueError, OverflowError):
        return
    assert result is None, f"allocate_slots({num_new_tokens}) granted: {result!r}"


def test_allocate_slots_huge_count_on_forked_sequence_changes_nothing() -> None:
    """A request whose num_tokens + n would wrap must change nothing (it
    once ran the copy-on-write before failing, losing the copy order)."""
    kv = KVCacheManager(8, 4, enable_prefix_caching=False)
    seq = kv.create_sequence()
    kv.allocate_slots(seq, 5)
    child = kv.fork(seq)
    assert kv.blocks_needed(child, USIZE_MAX - 3) > kv.num_available_blocks
    before = manager_snapshot(kv, [seq, child])
    refuse_or_reject(kv, child, USIZE_MAX - 3)
    assert manager_snapshot(kv, [seq, child]) == before
    kv.check_invariants()


def test_allocate_slots_huge_count_does_not_shrink_a_sequence() -> None:
    """3 tokens + (2**64 - 2) must not wrap to 1 and be granted."""
    kv = KVCacheManager(8, 4, enable_prefix_caching=False)
    seq = kv.create_sequence()
    kv.allocate_slots(seq, 3)
    before = manager_snapshot(kv, [seq])
    refuse_or_reject(kv, seq, USIZE_MAX - 1)
    assert manager_snapshot(kv, [seq]) == before


def test_slot_mapping_wrapping_range_is_a_value_error() -> None:
    kv = KVCacheManager(8, 4)
    seq = kv.create_sequence()
    kv.allocate_slots(seq, 5)
    with pytest.raises(ValueError):
        kv.slot_mapping(seq, USIZE_MAX, 1)


def test_slot_mapping_huge_count_is_a_value_error() -> None:
    kv = KVCacheManager(8, 4)
    seq = kv.create_sequence()
    kv.allocate_slots(seq, 5)
    with pytest.raises(ValueError):
        kv.slot_mapping(seq, 0, 2**61)


def test_block_pool_huge_allocation_returns_none() -> None:
    pool = BlockPool(4, 16)
    assert pool.allocate(2**61) is None
    assert pool.num_free == 4


def test_kvpage_error_pickles() -> None:
    """Errors must cross process boundaries (multiprocessing, a serving
    frontend), so KVPageError names its importable module."""
    kv = KVCacheManager(4, 4)
    with pytest.raises(KVPageError) as info:
        kv.num_tokens(99)
    clone = pickle.loads(pickle.dumps(info.value))
    assert type(clone) is KVPageError and str(clone) == str(info.value)


# --------------------------------------------------------------------------
# 3. Concrete behaviour.
# --------------------------------------------------------------------------


def test_position_37_at_block_16_is_logical_block_2_offset_5() -> None:
    kv = KVCacheManager(64, 16, enable_prefix_caching=False)
    seq = kv.create_sequence()
    kv.allocate_slots(seq, 40)
    table = kv.block_table(seq).tolist()
    assert len(table) == 3
    slots = kv.slot_mapping(seq, 0, 40)
    assert slots[37] == table[2] * 16 + 5
    assert kv.slot_mapping(seq, 37, 1).tolist() == [table[2] * 16 + 5]
    expected = [table[p // 16] * 16 + p % 16 for p in range(40)]
    assert slots.tolist() == expected


def test_block_pool_allocates_k_blocks_all_or_nothing() -> None:
    pool = BlockPool(8, 4)
    first = pool.allocate(3)
    assert first is not None and first.tolist() == [0, 1, 2]
    assert pool.allocate(6) is None
    assert pool.num_free == 5, "a failed allocation takes nothing"
    rest = pool.allocate(5)
    assert rest is not None and sorted(rest.tolist()) == [3, 4, 5, 6, 7]
    assert pool.allocate(1) is None
    empty = pool.allocate(0)
    assert empty is not None and empty.tolist() == []
    pool.check_invariants()


def test_allocate_slots_is_all_or_nothing() -> None:
    kv = KVCacheManager(4, 4, enable_prefix_caching=False)
    seq = kv.create_sequence()
    assert kv.allocate_slots(seq, 6) is not None  # 2 blocks, 2 left
    assert kv.blocks_needed(seq, 11) == 3  # 17 tokens -> 5 blocks
    before = manager_snapshot(kv, [seq])
    assert kv.allocate_slots(seq, 11) is None
    assert manager_snapshot(kv, [seq]) == before
    assert kv.blocks_needed(seq, 10) == 2  # 16 tokens -> exactly the 2 remaining
    assert kv.allocate_slots(seq, 10) is not None
    assert kv.num_free_blocks == 0 and kv.num_tokens(seq) == 16
    kv.check_invariants()


def test_refused_allocation_evicts_nothing() -> None:
    kv = KVCacheManager(4, 4, enable_prefix_caching=True)
    cache_and_free(kv, list(range(8)))  # 2 cached-unreferenced blocks, 2 free
    seq = kv.create_sequence()
    assert (kv.num_free_blocks, kv.num_available_blocks) == (2, 4)
    before = manager_snapshot(kv, [seq])
    assert kv.allocate_slots(seq, 17) is None  # 5 blocks > 4 available
    assert manager_snapshot(kv, [seq]) == before, "a refused allocation must not evict"
    assert kv.allocate_slots(seq, 16) is not None  # 4 blocks: evicts both cached ones
    assert kv.prefix_cache_stats()["evicted_blocks"] == 2 and kv.num_cached_blocks == 0
    kv.check_invariants()


def test_fork_then_first_write_copies_only_the_partial_last_block() -> None:
    kv = KVCacheManager(16, 4, enable_prefix_caching=False)
    parent = kv.create_sequence()
    kv.allocate_slots(parent, 6)  # block 0 full, block 1 holds 2 of 4
    child = kv.fork(parent)
    shared = kv.block_table(parent).tolist()
    assert kv.block_table(child).tolist() == shared
    assert kv.num_free_blocks == 14, "fork allocates nothing"
    assert [kv.refcount(b) for b in shared] == [2, 2]

    copies = kv.allocate_slots(child, 1)
    child_table = kv.block_table(child).tolist()
    assert copies is not None and copies.tolist() == [[shared[1], child_table[1]]]
    assert child_table[0] == shared[0], "full blocks are never copied"
    assert [kv.refcount(b) for b in shared] == [2, 1]
    parent_copies = kv.allocate_slots(parent, 1)
    assert parent_copies is not None and parent_copies.shape == (0, 2)
    assert kv.block_table(parent).tolist() == shared

    # At a block boundary nothing is shared for writing: no copy at all.
    full = kv.create_sequence()
    kv.allocate_slots(full, 8)
    twin = kv.fork(full)
    for seq in (full, twin):
        copies = kv.allocate_slots(seq, 1)
        assert copies is not None and copies.shape == (0, 2)
    kv.check_invariants()


def test_sixteen_conversations_share_thirteen_blocks_via_fork() -> None:
    kv = KVCacheManager(256, 16, enable_prefix_caching=False)
    prompt = kv.create_sequence()
    kv.allocate_slots(prompt, 200)  # ceil(200 / 16) = 13 blocks, the last holds 8
    children = [kv.fork(prompt) for _ in range(15)]
    assert kv.num_referenced_blocks == 13, "16 conversations, 13 blocks instead of 208"
    # Each conversation's first reply token copies the shared partial block
    # (the last writer owns the original), never the 12 full ones.
    num_copies = 0
    for seq in [*children, prompt]:
        copies = kv.allocate_slots(seq, 1)
        assert copies is not None
        num_copies += len(copies)
    assert num_copies == 15
    assert kv.num_referenced_blocks == 12 + 16
    kv.check_invariants()


def test_sixteen_conversations_share_twelve_full_blocks_via_prefix_cache() -> None:
    kv = KVCacheManager(64, 16, enable_prefix_caching=True)
    system = list(range(200))
    first = kv.create_sequence()
    kv.allocate_slots(first, 200)
    assert kv.cache_blocks(first, system) == 12, "only full blocks are cached"
    for _ in range(15):
        seq = kv.create_sequence()
        assert kv.match_prefix(seq, system[:199]) == 192
        kv.allocate_slots(seq, 8)
    assert kv.num_referenced_blocks == 12 + 16, "12 shared full + 16 private partial blocks"
    stats = kv.prefix_cache_stats()
    assert stats["hit_blocks"] == 15 * 12 and stats["queries"] == 15
    kv.check_invariants()


def cache_and_free(kv: KVCacheManager, tokens: list[int]) -> None:
    seq = kv.create_sequence()
    matched = kv.match_prefix(seq, tokens)
    kv.allocate_slots(seq, len(tokens) - matched)
    kv.cache_blocks(seq, tokens)
    kv.free_sequence(seq)


def probe_match(kv: KVCacheManager, tokens: list[int]) -> int:
    probe = kv.create_sequence()
    matched = kv.match_prefix(probe, tokens)
    kv.free_sequence(probe)
    return matched


@pytest.mark.parametrize("touch_old_again", [False, True])
def test_lru_eviction_takes_the_least_recently_used_prompts_leaf(touch_old_again: bool) -> None:
    kv = KVCacheManager(6, 4, enable_prefix_caching=True)
    old = list(range(100, 108))
    recent = list(range(200, 208))
    cache_and_free(kv, old)
    cache_and_free(kv, recent)
    if touch_old_again:
        cache_and_free(kv, old)  # a hit: old becomes the most recently used
    lru, mru = (recent, old) if touch_old_again else (old, recent)
    assert kv.num_free_blocks == 2 and kv.num_available_blocks == 6
    assert kv.num_cached_blocks == 4

    seq = kv.create_sequence()
    assert kv.allocate_slots(seq, 12) is not None  # 3 blocks: evicts exactly one
    assert kv.prefix_cache_stats()["evicted_blocks"] == 1
    # (Probing is a use: the probe released last becomes the most recent.)
    assert probe_match(kv, lru) == 4, "the LRU prompt lost its leaf, not its root"
    assert probe_match(kv, mru) == 8, "the recently used prompt is intact"
    kv.free_sequence(seq)

    # Explicit eviction follows the same order: now the LRU prompt's root.
    assert kv.evict(1) == 1
    assert probe_match(kv, lru) == 0
    assert probe_match(kv, mru) == 8
    kv.check_invariants()


def test_per_step_arrays_are_numpy_int32() -> None:
    kv = KVCacheManager(16, 4, enable_prefix_caching=False)
    seq = kv.create_sequence()
    copies = kv.allocate_slots(seq, 6)
    assert_int32_array(copies, 2)
    assert copies is not None and copies.shape == (0, 2)
    assert_int32_array(kv.slot_mapping(seq, 0, 6), 1)
    assert_int32_array(kv.slot_mapping(seq, 6, 0), 1)
    assert_int32_array(kv.block_table(seq), 1)
    child = kv.fork(seq)
    copies = kv.allocate_slots(child, 1)
    assert_int32_array(copies, 2)
    assert copies is not None and copies.shape == (1, 2)
    assert_int32_array(BlockPool(4, 4).allocate(2), 1)
    assert isinstance(kv.prefix_cache_stats(), dict)


def test_different_salts_never_share_blocks() -> None:
    kv = KVCacheManager(32, 4, enable_prefix_caching=True)
    tokens = list(range(12))
    a = kv.create_sequence("tenant-a")
    kv.allocate_slots(a, 12)
    assert kv.cache_blocks(a, tokens) == 3
    b = kv.create_sequence("tenant-b")
    assert kv.match_prefix(b, tokens) == 0
    unsalted = kv.create_sequence()
    assert kv.match_prefix(unsalted, tokens) == 0
    a2 = kv.create_sequence("tenant-a")
    assert kv.match_prefix(a2, tokens) == 12
    assert kv.block_table(a2).tolist() == kv.block_table(a).tolist()
    kv.check_invariants()


def test_hash_collision_never_matches_the_wrong_tokens() -> None:
    """Two different blocks with equal block hashes (built from the Python
    mirror of the hash in tests/core_model.py): the second is not cached, and
    looking it up never returns the first block's KV."""
    first = [5, 6, 7, 8]
    second = colliding_block(first)
    kv = KVCacheManager(8, 4, enable_prefix_caching=True)
    a = kv.create_sequence()
    kv.allocate_slots(a, 4)
    assert kv.cache_blocks(a, first) == 1
    b = kv.create_sequence()
    kv.allocate_slots(b, 8)
    inserted = kv.cache_blocks(b, [*second, 1, 1, 1, 1])
    if inserted != 0:
        pytest.skip("tests/core_model.py no longer mirrors hash_block_tokens: update it")
    assert probe_match(kv, [*second, 1, 1, 1, 1]) == 0, "equal hashes, different tokens: no hit"
    assert probe_match(kv, first) == 4
    # The sequence stops caching after a collision, but keeps its KV.
    kv.allocate_slots(b, 4)
    assert kv.cache_blocks(b, [*second, 1, 1, 1, 1, 2, 2, 2, 2]) == 0
    assert kv.num_tokens(b) == 12
    kv.check_invariants()


def test_zero_token_allocation_on_a_shared_partial_block_is_a_no_op() -> None:
    """allocate_slots(seq, 0) is a no-op even when the last block is shared.
    (A debug build of the core panics here: see the report.)"""
    kv = KVCacheManager(8, 4, enable_prefix_caching=False)
    parent = kv.create_sequence()
    kv.allocate_slots(parent, 5)
    child = kv.fork(parent)
    before = manager_snapshot(kv, [parent, child])
    assert kv.blocks_needed(child, 0) == 0
    copies = kv.allocate_slots(child, 0)
    assert copies is not None and copies.shape == (0, 2)
    assert manager_snapshot(kv, [parent, child]) == before
    kv.check_invariants()


def test_fork_before_caching_then_both_cache() -> None:
    """Parallel sampling: fork right after prefill, register blocks later.
    (A debug build of the core panics here: see the report.)"""
    kv = KVCacheManager(8, 4, enable_prefix_caching=True)
    tokens = [5, 6, 7, 8]
    parent = kv.create_sequence()
    kv.allocate_slots(parent, 4)
    child = kv.fork(parent)
    assert kv.cache_blocks(parent, tokens) == 1
    assert kv.cache_blocks(child, tokens) == 0
    kv.check_invariants()
    assert probe_match(kv, tokens) == 4
    kv.free_sequence(parent)
    kv.free_sequence(child)
    kv.check_invariants()
    assert kv.num_referenced_blocks == 0 and kv.num_available_blocks == 8


def test_reset_prefix_cache_frees_unreferenced_and_keeps_live_blocks() -> None:
    kv = KVCacheManager(8, 4, enable_prefix_caching=True)
    tokens = list(range(8))
    live = kv.create_sequence()
    kv.allocate_slots(live, 8)
    kv.cache_blocks(live, tokens)
    cache_and_free(kv, [9, 9, 9, 9])
    assert kv.num_free_blocks == 5 and kv.num_cached_blocks == 3
    kv.reset_prefix_cache()
    assert kv.num_cached_blocks == 0 and kv.num_free_blocks == 6
    assert probe_match(kv, tokens) == 0
    assert kv.num_tokens(live) == 8 and len(kv.block_table(live)) == 2
    kv.free_sequence(live)
    assert kv.num_free_blocks == 8
    kv.check_invariants()


def test_package_reexports_the_core() -> None:
    assert kvpage.KVCacheManager is KVCacheManager
    assert kvpage.BlockPool is BlockPool
    assert issubclass(kvpage.KVPageError, Exception)
