#!/usr/bin/env bash
# The environment of the tunix adapter's tests: kvpage[tunix] pins older
# transformers/safetensors than requirements-dev.txt, so it gets its own
# virtualenv (.venv-tunix) that sees this checkout's python/ (built by the
# README's setup) instead of a second build. scripts/test.sh runs
# tests/integrations/test_tunix_rollout.py in it when it exists.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv-tunix
.venv-tunix/bin/python -m pip install --quiet --upgrade pip
.venv-tunix/bin/python -m pip install --quiet "google-tunix==0.1.7" "jax==0.10.2" \
    "jaxlib==0.10.2" "gguf==0.19.0" "pytest>=8" "hypothesis==6.170.15"
site=$(.venv-tunix/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "$PWD/python" > "$site/kvpage_checkout.pth"
