#!/usr/bin/env bash
# The whole test suite: Rust core (no Python needed) then Python tests.
# Run from a checkout after the README's two setup commands.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== cargo test (Rust core)"
cargo test --quiet
echo "== stubtest (python/kvpage/_core.pyi against the built kvpage._core)"
python -m mypy.stubtest kvpage._core
echo "== pytest (bindings, scheduler, kernels, model)"
# 8 simulated CPU devices for the sharding tests; kernels run in interpret mode.
export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=8"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
# Test files are shared out to KVPAGE_TEST_WORKERS processes (default 2; each file runs
# whole in one, so module fixtures hold): most of the suite is XLA compiling, on one
# core at a time. 1 runs them in this process.
workers="${KVPAGE_TEST_WORKERS:-2}"
if [ "$workers" -gt 1 ]; then
    python -m pytest -q -p no:cacheprovider -n "$workers" --dist loadfile "$@"
else
    python -m pytest -q -p no:cacheprovider "$@"
fi
if [ -x .venv-tunix/bin/python ]; then
    echo "== pytest (tunix adapter, in .venv-tunix)"
    .venv-tunix/bin/python -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning \
        tests/integrations/test_tunix_rollout.py tests/integrations/test_tunix_lora.py
fi
