"""Pure-Python mirrors of kvpage core internals that the binding tests need.

Only what cannot be observed through the API lives here: the prefix cache's
block hash (``hash_block_tokens`` in ``rust/kv/prefix_cache.rs``), so that a test
can build two different blocks with equal hashes and check that a hash
collision never turns into a wrong prefix match. Keep it in step with the
Rust function; the collision test skips (and says so) when they drift apart.
"""

from collections.abc import Sequence

MASK = 2**64 - 1
K1 = 0x9E37_79B9_7F4A_7C15
K2 = 0xC2B2_AE3D_27D4_EB4F
LANE_A = 0x243F_6A88_85A3_08D3
LANE_B = 0x1319_8A2E_0370_7344


def rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & MASK


def rotr(x: int, r: int) -> int:
    return rotl(x, 64 - r)


def mix64(z: int) -> int:
    """SplitMix64's finalizer."""
    z = ((z ^ (z >> 30)) * 0xBF58_476D_1CE4_E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D0_49BB_1331_11EB) & MASK
    return z ^ (z >> 31)


def _lanes(tokens: Sequence[int]) -> tuple[int, int]:
    a, b = LANE_A, LANE_B
    quads = len(tokens) // 4 * 4
    for i in range(0, quads, 4):
        w0 = tokens[i] | tokens[i + 1] << 32
        w1 = tokens[i + 2] | tokens[i + 3] << 32
        a = rotl(((a ^ w0) * K1) & MASK, 29)
        b = rotl(((b ^ w1) * K2) & MASK, 31)
    for t in tokens[quads:]:
        a = rotl(((a ^ t) * K1) & MASK, 29)
    return a, b


def hash_block_tokens(tokens: Sequence[int]) -> int:
    """Mirror of ``prefix_cache::hash_block_tokens``."""
    a, b = _lanes(tokens)
    return mix64(a ^ rotl(b, 17) ^ len(tokens))


def colliding_block(block: Sequence[int]) -> list[int]:
    """A different 4-token block with the same ``hash_block_tokens``.

    With one quad the hash is ``mix64(a ^ rotl(b, 17) ^ 4)`` where lane ``a``
    depends only on tokens 0-1 and lane ``b`` bijectively on tokens 2-3: change
    token 0, then solve lane ``b`` for the tokens 2-3 that restore the hash.
    """
    assert len(block) == 4
    a, b = _lanes(block)
    target = a ^ rotl(b, 17)
    other = [block[0] ^ 1, block[1]]
    a2, _ = _lanes([*other, 0, 0])
    b2 = rotr(target ^ a2, 17)
    w1 = ((rotr(b2, 31) * pow(K2, -1, 2**64)) & MASK) ^ LANE_B
    result = [*other, w1 & 0xFFFF_FFFF, w1 >> 32]
    assert result != list(block) and hash_block_tokens(result) == hash_block_tokens(block)
    return result
