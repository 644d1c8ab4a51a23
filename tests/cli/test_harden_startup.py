"""Startup on a hostile model directory: weights come from safetensors only
(a pickle is never unpickled, not even one named ``model.safetensors``), and
a malformed ``config.json`` or safetensors file is a clear error naming the
file, which ``kvpage serve`` reports as ``error: ...`` with exit status 2
before it binds a port. (More loader errors: ``test_model_loader.py``.)"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import socket
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from kvpage.model import CheckpointError, load_model

PYTHON_DIR = str(Path(__file__).parents[2] / "python")


class _Evil:
    """Unpickling this creates the file ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (Path.write_text, (str(self.marker), "unpickled!"))  # type: ignore[return-value]


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _config(**changes: object) -> Callable[[Path], None]:
    def edit(model_dir: Path) -> None:
        raw = json.loads((model_dir / "config.json").read_text())
        for key, value in changes.items():
            if value is None:
                raw.pop(key, None)
            else:
                raw[key] = value
        (model_dir / "config.json").write_text(json.dumps(raw))

    return edit


def _write(name: str, data: bytes) -> Callable[[Path], None]:
    return lambda model_dir: (model_dir / name).write_bytes(data)


def _header(header: dict[str, object], payload: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + payload


MALFORMED: dict[str, tuple[Callable[[Path], None], str]] = {
    # id: (how to break the directory, what the error must say)
    "config-not-json": (
        _write("config.json", b"{not json"),
        r"malformed model config .*config\.json",
    ),
    "config-empty": (_write("config.json", b""), r"malformed model config .*config\.json"),
    "config-a-list": (_write("config.json", b"[]"), "top level is not an object"),
    "config-not-utf8": (_write("config.json", b'{"a": "\xff"}'), r"config\.json"),
    "config-no-vocab-size": (_config(vocab_size=None), "vocab_size"),
    "config-unknown-architecture": (
        _config(architectures=["EvilForCausalLM"]),
        "unsupported architecture",
    ),
    "config-negative-size": (
        _config(hidden_size=-64), r"hidden_size must be an int in \[1, \d+\], got -64"
    ),
    "config-zero-heads": (
        _config(num_attention_heads=0), r"num_heads must be an int in \[1, \d+\], got 0"
    ),
    "st-empty": (_write("model.safetensors", b""), r"malformed safetensors file .*too short"),
    "st-truncated-header": (
        _write("model.safetensors", struct.pack("<Q", 10**6) + b"{}"),
        "bad header length",
    ),
    "st-header-length-2**63": (
        _write("model.safetensors", struct.pack("<Q", 2**63) + b"{}"),
        "bad header length",
    ),
    "st-header-not-json": (
        _write("model.safetensors", _header({})[:8] + b"\xff" * 2),
        "malformed safetensors file",
    ),
    "st-offsets-past-the-end": (
        _write(
            "model.safetensors",
            _header(
                {
                    "model.embed_tokens.weight": {
                        "dtype": "F32",
                        "shape": [2, 2],
                        "data_offsets": [0, 10**12],
                    }
                },
                b"\0" * 16,
            ),
        ),
        "do not fit",
    ),
    "st-wrong-dtype-name": (
        _write(
            "model.safetensors",
            _header(
                {
                    "model.embed_tokens.weight": {
                        "dtype": "EVIL",
                        "shape": [4],
                        "data_offsets": [0, 16],
                    }
                },
                b"\0" * 16,
            ),
        ),
        "malformed safetensors file|dtype",
    ),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_model_directory_is_a_clear_error(
    tiny_model_dir: Path, tmp_path: Path, name: str
) -> None:
    breaks, message = MALFORMED[name]
    model_dir = _copy(tiny_model_dir, tmp_path / name)
    breaks(model_dir)
    with pytest.raises(CheckpointError, match=message):
        load_model(model_dir)


@pytest.mark.parametrize("where", ["pytorch_model.bin", "model.safetensors"])
def test_pickled_weights_are_never_unpickled(
    tiny_model_dir: Path, tmp_path: Path, where: str
) -> None:
    model_dir = _copy(tiny_model_dir, tmp_path / "model")
    (model_dir / "model.safetensors").unlink()
    marker = tmp_path / "marker"
    (model_dir / where).write_bytes(pickle.dumps(_Evil(marker)))
    with pytest.raises(CheckpointError, match="pickle|malformed safetensors"):
        load_model(model_dir)
    assert not marker.exists()


def test_serve_on_a_malformed_model_exits_2_before_binding(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    model_dir = _copy(tiny_model_dir, tmp_path / "model")
    (model_dir / "config.json").write_text("{oops")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = subprocess.run(
        [sys.executable, "-m", "kvpage.cli", "serve", str(model_dir), "--port", str(port)],
        env={**os.environ, "PYTHONPATH": PYTHON_DIR},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"error: malformed model config {model_dir / 'config.json'}" in result.stderr
    assert "Traceback" not in result.stderr
    assert "Uvicorn running" not in result.stderr


def test_absurd_sizes_and_escaping_weight_paths_are_rejected(tmp_path: Path) -> None:
    import json

    from kvpage.model.config import ModelConfig
    from kvpage.model.errors import CheckpointError
    from kvpage.model.loader import load_model
    from kvpage.model.tiny_model import tiny_llama_config

    with pytest.raises(ValueError, match="num_layers"):
        ModelConfig.from_hf_dict(tiny_llama_config(512, num_hidden_layers=10**9))
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(tiny_llama_config(512)))
    index = {"weight_map": {"model.embed_tokens.weight": "../../etc/passwd"}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="outside the model directory"):
        load_model(model)
