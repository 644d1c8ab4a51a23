//! Weights packed into tiles of sixteen rows for the lanes kernel: the layout.
//!
//! Owns [`packs`], [`pack_tiles`] and [`unpack_tile`]: where each byte of a
//! tile goes (one function, [`for_each_run`], walks it for both). The kernel
//! that reads the layout is `lanes_avx512::tile_packed`; Python packs with
//! `kvpage.quant.tiles` (the same layout, checked against this one by its
//! tests) and decides what to pack in `kvpage.quant.packing`. Portable code:
//! byte moves only.

use super::call::OUTS_PER_TILE as TILE;
use super::formats::{QuantType, SUB};

/// Whether weights of `kind` may be packed into tiles ([`pack_tiles`]): the
/// formats whose block is `f16` fields then sixteen bytes of nibbles.
pub fn packs(kind: QuantType) -> bool {
    matches!(kind, QuantType::Q4_0 | QuantType::Q4_1)
}

/// Q4_0 or Q4_1 weights `[outs, inner]` (`outs` a multiple of 16) packed for
/// `lanes_avx512::tile_packed`: per tile of sixteen rows and block `b`, each `f16` field
/// of the block (Q4_0: `d`; Q4_1: `d`, then `m`) of the sixteen rows (32
/// bytes a field, row `o` at `2o`), then their nibbles as
/// the lanes kernel's `TileRows::bytes16` gives them (register `q`, lane `o` at `64q + 4o`:
/// row `o`'s bytes `4q..4q + 4`). The same bytes, tile by tile, in the order
/// the kernel reads them: a tile is one stream, and its transposition was paid
/// once, here (`expert_ffn` at 32 tokens of bench moe's model: 1.14x,
/// 2026-11-28, benches/RESULTS.md).
pub fn pack_tiles(kind: QuantType, rows: &[u8], outs: usize, inner: usize) -> Vec<u8> {
    assert!(packs(kind) && outs.is_multiple_of(TILE) && inner.is_multiple_of(SUB));
    let tile_bytes = TILE * (inner / SUB) * kind.block_bytes();
    assert_eq!(rows.len(), outs * tile_bytes / TILE);
    let mut packed = vec![0u8; rows.len()];
    for (rows, packed) in rows.chunks(tile_bytes).zip(packed.chunks_mut(tile_bytes)) {
        for_each_run(kind, inner, |row_at, packed_at, len| {
            packed[packed_at..packed_at + len].copy_from_slice(&rows[row_at..row_at + len]);
        });
    }
    packed
}

/// One tile of weights packed by [`pack_tiles`] back in GGUF's row order,
/// into `rows` (sixteen rows of `inner` inputs).
pub fn unpack_tile(kind: QuantType, packed: &[u8], inner: usize, rows: &mut [u8]) {
    debug_assert!(packed.len() == rows.len());
    for_each_run(kind, inner, |row_at, packed_at, len| {
        rows[row_at..row_at + len].copy_from_slice(&packed[packed_at..packed_at + len]);
    });
}

/// Every run of bytes a tile's packing moves: `(at in the rows, at in the
/// packed tile, length)` (the layout in [`pack_tiles`]' docs).
fn for_each_run(kind: QuantType, inner: usize, mut run: impl FnMut(usize, usize, usize)) {
    let bb = kind.block_bytes();
    let header = bb - 16;
    let row_bytes = inner / SUB * bb;
    for b in 0..inner / SUB {
        let block = b * TILE * bb;
        for o in 0..TILE {
            let src = o * row_bytes + b * bb;
            for field in 0..header / 2 {
                run(src + 2 * field, block + field * 2 * TILE + 2 * o, 2);
            }
            for q in 0..4 {
                run(
                    src + header + 4 * q,
                    block + header * TILE + 64 * q + 4 * o,
                    4,
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::quant::tests::random_weights;
    use crate::test_rng::SplitMix64 as TestRng;

    #[test]
    fn a_packed_tile_unpacks_to_its_rows_and_every_byte_moves_once() {
        let mut rng = TestRng::new(612);
        for kind in [QuantType::Q4_0, QuantType::Q4_1] {
            let (outs, inner) = (48, 96);
            let rows = random_weights(&mut rng, kind, outs, inner);
            let packed = pack_tiles(kind, &rows, outs, inner);
            let tile_bytes = rows.len() / (outs / TILE);
            let mut back = vec![0u8; rows.len()];
            for (packed, back) in packed.chunks(tile_bytes).zip(back.chunks_mut(tile_bytes)) {
                unpack_tile(kind, packed, inner, back);
            }
            assert_eq!(back, rows, "{kind:?}");
            let mut seen = vec![0u8; tile_bytes];
            for_each_run(kind, inner, |_, at, len| {
                seen[at..at + len].iter_mut().for_each(|s| *s += 1)
            });
            assert!(
                seen.iter().all(|&s| s == 1),
                "{kind:?}: a packed byte written twice or never"
            );
        }
        assert!(!packs(QuantType::Q8_0) && !packs(QuantType::Q4K));
    }
}
