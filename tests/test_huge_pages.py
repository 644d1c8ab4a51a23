"""The ``kvpage`` command's re-execution with glibc's huge-page tunable (huge_pages.py)."""

from __future__ import annotations

import sys
from typing import Any

import pytest
from kvpage import cli, huge_pages
from kvpage.huge_pages import TUNABLE, reexec_environment


def test_the_tunable_is_added_where_glibc_and_the_kernel_support_it() -> None:
    env = reexec_environment({"PATH": "/bin"}, (2, 36), "madvise")
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": TUNABLE}
    kept = reexec_environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, (2, 39), "always")
    assert kept is not None
    assert kept["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{TUNABLE}"


@pytest.mark.parametrize(
    "environ,glibc,thp",
    [
        ({"GLIBC_TUNABLES": TUNABLE}, (2, 36), "madvise"),  # already set: no loop
        ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, (2, 36), "madvise"),  # user's choice
        ({"KVPAGE_HUGE_PAGES": "0"}, (2, 36), "madvise"),  # opted out
        ({}, (2, 34), "madvise"),  # glibc without the tunable
        ({}, None, "always"),  # musl, macOS
        ({}, (2, 36), "never"),  # THP off in the kernel
        ({}, (2, 36), None),  # no THP at all
    ],
)
def test_no_reexecution_otherwise(environ: dict[str, str], glibc: Any, thp: Any) -> None:
    assert reexec_environment(environ, glibc, thp) is None


def test_the_command_executes_itself_once_with_the_tunable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[str, list[str], dict[str, str]]] = []
    monkeypatch.setattr(huge_pages.os, "execve", lambda *a: calls.append(a))
    monkeypatch.setattr(huge_pages, "glibc_version", lambda: (2, 36))
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "madvise")
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv("KVPAGE_HUGE_PAGES", raising=False)
    monkeypatch.setattr(sys, "argv", ["kvpage", "generate", "--max-tokens", "2"])
    huge_pages.reexec_with_huge_pages(sys.argv[1:])
    [(exe, argv, env)] = calls
    assert exe == sys.executable
    assert argv == [sys.executable, "-P", "-m", "kvpage.cli", "generate", "--max-tokens", "2"]
    assert env["GLIBC_TUNABLES"] == TUNABLE
    calls.clear()
    with pytest.raises(SystemExit):
        cli.main(["--help"])  # a caller in this process: never re-executed
    assert calls == []
    monkeypatch.setattr(sys, "argv", ["kvpage", "--help"])
    with pytest.raises(SystemExit):
        cli.main()  # the command itself (execve stubbed out, so it goes on to --help)
    assert [argv[4:] for _, argv, _ in calls] == [["--help"]]
