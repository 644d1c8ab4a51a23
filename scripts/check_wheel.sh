#!/usr/bin/env bash
# The wheel as a user installs it: build the manylinux_2_28 abi3 wheel, check
# its tag, install it into a fresh virtualenv with only its declared
# dependencies (+ the [serve] and [ray] extras), and run `kvpage --help`, `kvpage
# generate` (the tiny model that ships inside the wheel) and one chat
# completion against `kvpage serve`, all from outside the source tree.
#
#   bash scripts/check_wheel.sh [WHEEL]    # default: build one with maturin --zig
#
# Needs maturin and ziglang (requirements-dev.txt) to build, and a package
# index (or pip's cache) for the wheel's dependencies.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d "${TMPDIR:-/tmp}/kvpage-wheel.XXXXXX")"
server_pid=""
cleanup() {
    if [[ -n "$server_pid" ]] && kill -0 "$server_pid" 2>/dev/null; then
        kill "$server_pid" 2>/dev/null || true
        wait "$server_pid" 2>/dev/null || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT
if [[ $# -ge 1 ]]; then
    wheel="$1"
else
    echo "== wheel: maturin build --release --zig --compatibility manylinux_2_28"
    (cd "$repo" && maturin build --release --zig --compatibility manylinux_2_28 \
        --out "$work/wheels" --quiet)
    wheel="$(ls "$work"/wheels/kvpage-*.whl)"
fi
name="$(basename "$wheel")"
echo "== wheel: $name"
case "$name" in
    *abi3*manylinux_2_28*|*abi3*manylinux2014*|*abi3*manylinux_2_17*) ;;
    *) echo "error: $name is not an abi3 manylinux_2_28 (or older) wheel" >&2; exit 1 ;;
esac

echo "== fresh virtualenv with the wheel and its declared dependencies ([serve,ray])"
python3 -m venv "$work/venv"
py="$work/venv/bin/python"
"$py" -m pip install --quiet --upgrade pip
"$py" -m pip install --quiet "${wheel}[serve,ray]"
kvpage="$work/venv/bin/kvpage"
# kvpage's persistent compilation cache follows XDG: keep this check's out of ~/.cache.
# Set only now: maturin keeps its zig linker shims under XDG_CACHE_HOME, and a new
# linker path makes cargo rebuild every release artifact the editable install built
# (4 min on 2 cores); pip keeps its wheel cache there too.
export XDG_CACHE_HOME="$work/cache"
cd "$work"  # not the source tree: import the installed package

echo "== kvpage --help"
"$kvpage" --help >/dev/null
"$kvpage" bench --help >/dev/null

echo "== the host decode-attention kernel is exported and registers with XLA"
JAX_PLATFORMS=cpu "$py" -c 'from kvpage.kernels.host import cpu_decode_attention as k; assert k.available(), "kvpage_paged_decode_attention missing from _core"'

echo "== kvpage on Ray: the [ray] extra's modules import (tests/ray runs them)"
"$py" -c 'import kvpage.ray.application, kvpage.ray.ingress, kvpage.ray.router, kvpage.ray.replica'
"$kvpage" serve --help | grep -q -- "--replicas"

echo "== kvpage generate (the shipped tiny model)"
JAX_PLATFORMS=cpu "$kvpage" generate --prompt "The module" --max-tokens 8 --temperature 0 \
    | tee "$work/generate.txt"
grep -q "^--- prompt: 'The module'" "$work/generate.txt"

echo "== kvpage serve + one chat completion"
model="$("$py" -c 'from kvpage.assets import default_model_dir; print(default_model_dir())')"
port="$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
JAX_PLATFORMS=cpu "$kvpage" serve "$model" --host 127.0.0.1 --port "$port" \
    --served-model-name tiny --no-warmup --max-num-seqs 4 >"$work/serve.log" 2>&1 &
server_pid=$!
"$py" - "$port" <<'EOF' || { cat "$work/serve.log" >&2; exit 1; }
import json, sys, time, urllib.error, urllib.request

base = f"http://127.0.0.1:{sys.argv[1]}"
deadline = time.monotonic() + 180
while True:
    try:
        with urllib.request.urlopen(base + "/health", timeout=2) as r:
            if r.status == 200:
                break
    except (urllib.error.URLError, OSError):
        pass
    if time.monotonic() > deadline:
        sys.exit("the server did not become healthy within 180 s")
    time.sleep(0.5)
body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 8, "temperature": 0}
req = urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(),
                             {"content-type": "application/json"})
with urllib.request.urlopen(req, timeout=120) as r:
    out = json.load(r)
choice = out["choices"][0]
assert out["object"] == "chat.completion" and choice["finish_reason"] in ("stop", "length"), out
assert out["usage"]["completion_tokens"] >= 1, out
print("chat completion:", json.dumps(choice["message"]["content"]), out["usage"])
EOF
kill -TERM "$server_pid"
wait "$server_pid"  # a graceful shutdown exits 0
server_pid=""
echo "== wheel OK: $name"
