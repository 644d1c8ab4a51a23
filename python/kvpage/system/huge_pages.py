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
says when), before it imports JAX. ``KVPAGE_HUGE_PAGES=0`` turns that off; a
``GLIBC_TUNABLES`` the user set is kept (the tunable is appended to it), and one that
already sets ``glibc.malloc.hugetlb`` is left alone. A program that runs
:class:`kvpage.LLM` in its own process gets the same by starting with
``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` in its environment.

Contract of the re-execution (:func:`reexec_with_huge_pages`):

* It replays the interpreter's own command line, ``sys.orig_argv``
  (:func:`replay_command`): its options (``-I``, ``-O``, ``-X``, ``-W``, ...), its
  program (``-m kvpage.cli``, the ``kvpage`` script, ``-c``, ``-m cProfile ...``,
  ``coverage run ...``) and the command's arguments, with the same executable, working
  directory and environment (plus the two variables below). So the second process has
  the first's flags and module search path, and imports the same kvpage; it checks
  that it did, and warns if not (a program that changed directory or ``sys.path`` in
  a way that does not happen again).
* At most once: the second process is marked by ``KVPAGE_REEXECED`` in its environment
  (never by ``GLIBC_TUNABLES``, which an environment may drop); it removes the mark at
  once, so that commands it starts decide for themselves.
* A command line that cannot be replayed is not: an embedded interpreter (no
  ``sys.orig_argv``, or ``sys.executable`` is not the running program), a program read
  from stdin or typed at the prompt, a command whose arguments are not the
  interpreter's last ones. The command then runs on as it is, without huge pages, and
  says why at DEBUG on the ``kvpage.system.huge_pages`` logger. So does a failed exec.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

TUNABLE = "glibc.malloc.hugetlb=1"
OPT_OUT = "KVPAGE_HUGE_PAGES"
REEXECED = "KVPAGE_REEXECED"
"""Set only in the re-executed process's environment: the first process's kvpage
package directory (:data:`PACKAGE_DIR`)."""
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""The directory of the kvpage package this process imported."""
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_VALUE_LETTERS = "WX"  # CPython's one-letter options with a value, besides -c and -m
_VALUE_LONG_OPTIONS = ("--check-hash-based-pycs",)

logger = logging.getLogger(__name__)


class NotReplayable(Exception):
    """The interpreter's command line cannot be run again; the message says why."""


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
    glibc >= 2.35 with transparent huge pages available, when this process is not the
    re-executed one, the tunable is not set yet and ``KVPAGE_HUGE_PAGES`` is not ``0``."""
    current = environ.get("GLIBC_TUNABLES", "")
    if REEXECED in environ or environ.get(OPT_OUT) == "0" or "glibc.malloc.hugetlb" in current:
        return None
    if glibc is None or glibc < (2, 35) or thp not in ("always", "madvise"):
        return None
    env = dict(environ)
    env["GLIBC_TUNABLES"] = f"{current}:{TUNABLE}" if current else TUNABLE
    env[REEXECED] = PACKAGE_DIR
    return env


def _program(words: Sequence[str]) -> Literal["-c", "-m", "script"] | None:
    """What the interpreter ran, from its options and program (its command line without
    the executable and the program's arguments): ``-c CODE``, ``-m MODULE``, a script
    (a file, directory or zip), or None (stdin, the interactive prompt)."""
    rest = iter(words)
    for word in rest:
        if word == "--":  # the script follows
            word = next(rest, "-")
            return "script" if word != "-" else None
        if word == "-":
            return None
        if not word.startswith("-"):
            return "script"
        if word.startswith("--"):
            if word in _VALUE_LONG_OPTIONS:
                next(rest, None)
            continue
        for end, letter in enumerate(word[1:], start=2):  # a cluster such as -IOWerror
            if letter in "cm":
                return "-c" if letter == "c" else "-m"
            if letter in _VALUE_LETTERS:
                if end == len(word):  # "-W error": the value is the next word
                    next(rest, None)
                break
    return None


def replay_command(
    orig_argv: Sequence[str], args: Sequence[str], executable: str, *, embedded: bool
) -> list[str]:
    """The command line that runs this interpreter's program again: ``orig_argv`` (as
    ``sys.orig_argv``) with ``executable`` first. ``args`` are the command's arguments,
    which must be the last ones; ``embedded``: ``executable`` is not the running
    program. Raises :class:`NotReplayable`."""
    if embedded or not orig_argv or not executable:
        raise NotReplayable("an embedded interpreter (no interpreter command line to run)")
    split = len(orig_argv) - len(args)
    if split < 1 or list(orig_argv[split:]) != list(args):
        raise NotReplayable(
            "the command's arguments are not the interpreter's last ones "
            f"({list(args)!r}, {list(orig_argv)!r})")
    if _program(orig_argv[1:split]) is None:
        raise NotReplayable("the program came from stdin or the interactive prompt")
    return [executable, *orig_argv[1:]]


def _is_running(executable: str) -> bool:
    """Whether ``executable`` is the program this process runs (not an embedding one)."""
    try:
        return os.path.samefile(executable, "/proc/self/exe")
    except OSError:  # no /proc: glibc_version() decides
        return bool(executable)


def reexec_with_huge_pages(argv: Sequence[str]) -> None:
    """Replace this process by its own command line (``argv``: the command's arguments)
    with the tunable set, when :func:`reexec_environment` says so and it can be
    replayed; otherwise return. In the re-executed process, remove its mark."""
    first = os.environ.pop(REEXECED, None)
    if first is not None:
        if first != PACKAGE_DIR:
            logger.warning("run again with %s, kvpage was imported from %s, not from %s "
                           "as the first time", TUNABLE, PACKAGE_DIR, first)
        return
    env = reexec_environment(os.environ, glibc_version(), thp_mode())
    if env is None:
        return
    try:
        command = replay_command(getattr(sys, "orig_argv", ()), argv, sys.executable,
                                 embedded=not _is_running(sys.executable))
    except NotReplayable as why:
        logger.debug("not run again with %s: %s", TUNABLE, why)
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(command[0], command, env)
    except OSError as exc:
        logger.debug("not run again with %s: %s", TUNABLE, exc)  # run on without them
