#!/usr/bin/env bash
# The Rust kernel tests under AddressSanitizer (issue #46: ASan found the Q6_K kernel
# reading 2 bytes past its weights, which the ordinary tests could not see). Needs a
# nightly toolchain (-Zsanitizer is unstable); without one it says so and passes.
#   bash scripts/sanitize.sh            (~1 min from clean on 2 cores, kernels only)
set -euo pipefail
cd "$(dirname "$0")/.."
if ! rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
    echo "== sanitize: skipped (no nightly Rust toolchain: rustup toolchain install nightly)"
    exit 0
fi
target="$(rustc -vV | sed -n 's/^host: //p')"
echo "== sanitize: cargo +nightly test kernels:: under AddressSanitizer ($target)"
CARGO_TARGET_DIR=target/asan RUSTFLAGS="-Zsanitizer=address" \
    cargo +nightly test --quiet --lib --target "$target" kernels::
