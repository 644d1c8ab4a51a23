"""Transparent huge pages for the big host buffers XLA:CPU allocates every step.

XLA:CPU allocates an executable's temporaries afresh at each call. A prefill-sized
step's are tens of MB (the dequantized weights of a quantized model's layers, the MLP's
``[T, intermediate]`` activations), above glibc's largest mmap threshold (32 MB), so
each call maps fresh memory and the kernel faults it in 4 KiB at a time and zeroes it.
64 ShareGPT-like requests at concurrency 32 on SmolLM2 Q4_1 (``engine.step()``, one
process per run, alternated, 2026-11-26): 7.45 M minor page faults a run; with glibc's
``glibc.malloc.hugetlb=1`` tunable (glibc >= 2.35: malloc asks for transparent huge
pages on its mappings) 0.30-0.36 M, and 158.1 / 150.0 s became 150.0 / 147.8 s.

glibc reads the tunable when the process starts, so the ``kvpage`` command executes
itself again, once, with it added to ``GLIBC_TUNABLES`` (:func:`reexec_environment`
says when), before it imports JAX. ``KVPAGE_HUGE_PAGES=0`` turns that off. A program
that runs :class:`kvpage.LLM` in its own process gets the same by starting with
``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` in its environment.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

TUNABLE = "glibc.malloc.hugetlb=1"
OPT_OUT = "KVPAGE_HUGE_PAGES"
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def glibc_version() -> tuple[int, int] | None:
    """``(major, minor)`` of the running glibc, or None (another libc or platform)."""
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()  # "glibc 2.36"
        major, minor = version.split(".")[:2]
        return (int(major), int(minor)) if name == "glibc" else None
    except (AttributeError, ValueError, OSError):
        return None


def thp_mode() -> str | None:
    """The kernel's transparent-huge-page mode (``always``, ``madvise``, ``never``)."""
    try:
        text = _THP_MODE.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def reexec_environment(
    environ: Mapping[str, str], glibc: tuple[int, int] | None, thp: str | None
) -> dict[str, str] | None:
    """The environment to execute the command again with, or None to go on as is: on
    glibc >= 2.35 with transparent huge pages available, when the tunable is not set
    yet and ``KVPAGE_HUGE_PAGES`` is not ``0``."""
    current = environ.get("GLIBC_TUNABLES", "")
    if environ.get(OPT_OUT) == "0" or "glibc.malloc.hugetlb" in current:
        return None
    if glibc is None or glibc < (2, 35) or thp not in ("always", "madvise"):
        return None
    env = dict(environ)
    env["GLIBC_TUNABLES"] = f"{current}:{TUNABLE}" if current else TUNABLE
    return env


def reexec_with_huge_pages(argv: Sequence[str]) -> None:
    """Replace this process by ``python -P -m kvpage.cli *argv`` with the tunable set, when
    :func:`reexec_environment` says so; otherwise return."""
    env = reexec_environment(os.environ, glibc_version(), thp_mode())
    if env is None or not sys.executable:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        # -P: the working directory does not shadow the installed package
        os.execve(sys.executable, [sys.executable, "-P", "-m", "kvpage.cli", *argv], env)
    except OSError:
        return  # run on without huge pages
