#!/usr/bin/env bash
# The Rust kernel tests under AddressSanitizer, then the portable loops under Miri
# (issue #46: ASan found the AVX2 Q6_K kernel reading 2 bytes past its weights,
# which the ordinary tests could not see; rust/kernels/guard_page_tests.rs now
# would). Needs a nightly toolchain (-Zsanitizer is unstable); without one it
# says so and passes, and without Miri it runs ASan only.
#   bash scripts/sanitize.sh
# From clean on the 2-core machine of benches/RESULTS.md, 3 min in all: ASan
# 103 s (97 s of it the build), Miri 80 s (68 s the build). SANITIZE_TARGET_DIR
# (default: target) holds both builds, in asan/ and miri/.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
    echo "== sanitize: skipped (no nightly Rust toolchain: rustup toolchain install nightly)"
    exit 0
fi
dir="${SANITIZE_TARGET_DIR:-target}"
host="$(rustc -vV | sed -n 's/^host: //p')"
echo "== sanitize: cargo +nightly test kernels:: under AddressSanitizer ($host)"
CARGO_TARGET_DIR="$dir/asan" RUSTFLAGS="-Zsanitizer=address" \
    cargo +nightly test --quiet --lib --target "$host" kernels::

if ! cargo +nightly miri --version >/dev/null 2>&1; then
    echo "== sanitize: Miri skipped (rustup +nightly component add miri)"
    exit 0
fi
# Under Miri no SIMD feature is detected, so every product runs its portable
# loop; the random-shape checks shrink there (cfg!(miri)). Each filter names
# tests that finish in seconds when interpreted.
echo "== sanitize: the portable kernels under Miri"
CARGO_TARGET_DIR="$dir" cargo +nightly miri test --quiet --lib -- \
    kernels::quant::tests::every_type_matches \
    kernels::quant::tests::the_portable_loop \
    kernels::quant::tests::wrong_sizes \
    kernels::quant::tests::zero_inputs \
    kernels::quant::tests::q4_k_and_q6_k_unpack \
    kernels::quant::activations::tests::a_block_scale \
    kernels::cpu_matmul::tests::the_portable_loop \
    kernels::cpu_matmul::tests::matches_a_float64 \
    kernels::cpu_matmul::tests::wrong_sizes \
    kernels::parallel::tests \
    kernels::xla_ffi::tests
