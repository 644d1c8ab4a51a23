"""The ``kvpage`` command's re-execution with glibc's huge-page tunable (huge_pages.py).

The subprocess tests run the real command line (``python [options] -m kvpage.cli
--help``, a launcher script, ``-m cProfile``) with a clean environment under ``tmp_path``
and watch both processes through a reporter (a ``sitecustomize`` on ``PYTHONPATH``, or
the launcher itself under ``-I``), which appends one JSON line per event to
``$PROBE_LOG``: ``start``, ``exec`` (the ``os.exec`` audit event) and ``exit``.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import kvpage
import pytest
from kvpage import cli
from kvpage.system import huge_pages
from kvpage.system.huge_pages import (
    PACKAGE_DIR,
    REEXECED,
    TUNABLE,
    NotReplayable,
    reexec_environment,
    replay_command,
)


def test_the_tunable_is_added_where_glibc_and_the_kernel_support_it() -> None:
    env = reexec_environment({"PATH": "/bin"}, (2, 36), "madvise")
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": TUNABLE, REEXECED: PACKAGE_DIR}
    kept = reexec_environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, (2, 39), "always")
    assert kept is not None
    assert kept["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{TUNABLE}"  # merged


@pytest.mark.parametrize(
    "environ,glibc,thp",
    [
        ({"GLIBC_TUNABLES": TUNABLE}, (2, 36), "madvise"),  # already set
        ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, (2, 36), "madvise"),  # user's choice
        ({REEXECED: "/somewhere/kvpage"}, (2, 36), "madvise"),  # the re-executed process
        ({"KVPAGE_HUGE_PAGES": "0"}, (2, 36), "madvise"),  # opted out
        ({}, (2, 34), "madvise"),  # glibc without the tunable
        ({}, None, "always"),  # musl, macOS
        ({}, (2, 36), "never"),  # THP off in the kernel
        ({}, (2, 36), None),  # no THP at all
    ],
)
def test_no_reexecution_otherwise(environ: dict[str, str], glibc: Any, thp: Any) -> None:
    assert reexec_environment(environ, glibc, thp) is None


@pytest.mark.parametrize(
    "orig_argv,args",
    [
        (["python", "-I", "-O", "-X", "dev", "-Wd", "-m", "kvpage.cli", "serve", "m"],
         ["serve", "m"]),
        (["/venv/bin/python", "/venv/bin/kvpage", "serve", "m"], ["serve", "m"]),  # script
        (["python", "-c", "from kvpage.cli import main; main()", "--help"], ["--help"]),
        (["python", "-IcCODE"], []),
        (["python", "-m", "cProfile", "-o", "p", "-m", "kvpage.cli", "-h"], ["-h"]),
        (["python", "-X", "importtime", "-OO", "-Werror", "--check-hash-based-pycs", "never",
          "-s", "--", "-script.py"], []),
    ],
)
def test_the_interpreter_command_line_is_replayed(orig_argv: list[str], args: list[str]) -> None:
    assert replay_command(orig_argv, args, "/x/python", embedded=False) == [
        "/x/python", *orig_argv[1:]]


@pytest.mark.parametrize(
    "orig_argv,args,embedded,why",
    [
        ([], [], False, "embedded"),
        (["uwsgi", "--module", "app"], [], True, "embedded"),
        (["python"], [], False, "stdin"),  # the interactive prompt
        (["python", "-", "--help"], ["--help"], False, "stdin"),
        (["python", "-I", "-W", "error"], [], False, "stdin"),
        (["python", "-X", "x.py"], [], False, "stdin"),  # x.py is -X's value
        (["python", "-m", "kvpage.cli", "serve"], ["generate"], False, "arguments"),
        (["python"], ["serve"], False, "arguments"),
    ],
)
def test_what_cannot_be_replayed(
    orig_argv: list[str], args: list[str], embedded: bool, why: str
) -> None:
    with pytest.raises(NotReplayable, match=why):
        replay_command(orig_argv, args, "/x/python", embedded=embedded)


@pytest.fixture
def execve_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, list[str], dict[str, str]]]:
    """``os.execve`` stubbed out (recorded), on a machine that supports the tunable."""
    calls: list[tuple[str, list[str], dict[str, str]]] = []
    monkeypatch.setattr(huge_pages.os, "execve", lambda *a: calls.append(a))
    monkeypatch.setattr(huge_pages, "glibc_version", lambda: (2, 36))
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "madvise")
    for name in ("GLIBC_TUNABLES", "KVPAGE_HUGE_PAGES", REEXECED):
        monkeypatch.delenv(name, raising=False)
    return calls


def test_the_command_executes_itself_once_with_the_tunable(
    monkeypatch: pytest.MonkeyPatch, execve_calls: list[Any]
) -> None:
    monkeypatch.setattr(sys, "argv", ["kvpage", "generate", "--max-tokens", "2"])
    orig = [sys.executable, "-X", "dev", "/venv/bin/kvpage", "generate", "--max-tokens", "2"]
    monkeypatch.setattr(sys, "orig_argv", orig)
    huge_pages.reexec_with_huge_pages(sys.argv[1:])
    [(exe, argv, env)] = execve_calls
    assert exe == sys.executable
    assert argv == [sys.executable, *orig[1:]]
    assert env["GLIBC_TUNABLES"] == TUNABLE
    assert env[REEXECED] == PACKAGE_DIR
    execve_calls.clear()
    with pytest.raises(SystemExit):
        cli.main(["--help"])  # a caller in this process: never re-executed
    assert execve_calls == []
    monkeypatch.setattr(sys, "argv", ["kvpage", "--help"])
    monkeypatch.setattr(sys, "orig_argv", [sys.executable, "/venv/bin/kvpage", "--help"])
    with pytest.raises(SystemExit):
        cli.main()  # the command itself (execve stubbed out, so it goes on to --help)
    assert [argv[1:] for _, argv, _ in execve_calls] == [["/venv/bin/kvpage", "--help"]]


def test_the_reexecuted_process_removes_its_mark_and_checks_its_kvpage(
    monkeypatch: pytest.MonkeyPatch, execve_calls: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(sys, "orig_argv", [sys.executable, "-m", "kvpage.cli", "x"])
    monkeypatch.setenv(REEXECED, PACKAGE_DIR)
    with caplog.at_level(logging.DEBUG, logger="kvpage.system.huge_pages"):
        huge_pages.reexec_with_huge_pages(["x"])
    assert execve_calls == [] and REEXECED not in os.environ and caplog.records == []
    monkeypatch.setenv(REEXECED, "/another/checkout/kvpage")
    with caplog.at_level(logging.DEBUG, logger="kvpage.system.huge_pages"):
        huge_pages.reexec_with_huge_pages(["x"])
    assert execve_calls == []
    [record] = caplog.records
    assert record.levelno == logging.WARNING and "/another/checkout/kvpage" in record.message


def test_a_command_line_that_cannot_be_replayed_is_logged_not_run(
    monkeypatch: pytest.MonkeyPatch, execve_calls: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(sys, "orig_argv", [sys.executable, "-", "x"])  # python - < script
    with caplog.at_level(logging.DEBUG, logger="kvpage.system.huge_pages"):
        huge_pages.reexec_with_huge_pages(["x"])
    assert execve_calls == []
    [record] = caplog.records
    assert record.levelno == logging.DEBUG and "stdin" in record.message


# ---- the real command line, in subprocesses ------------------------------------------

_SUPPORTED = reexec_environment({}, huge_pages.glibc_version(), huge_pages.thp_mode())
needs_tunable = pytest.mark.skipif(
    _SUPPORTED is None, reason="no glibc >= 2.35 with transparent huge pages here")

_REPORTER = """\
import atexit, json, os, sys

def _report(event, source={source!r}):
    kvpage = sys.modules.get("kvpage")
    line = dict(event=event, source=source, pid=os.getpid(), isolated=sys.flags.isolated,
                optimize=sys.flags.optimize, xoptions=sys._xoptions,
                warnoptions=sys.warnoptions, tunables=os.environ.get("GLIBC_TUNABLES"),
                reexeced=os.environ.get("KVPAGE_REEXECED"),
                kvpage=getattr(kvpage, "__file__", None))
    with open(os.environ["PROBE_LOG"], "a") as log:
        log.write(json.dumps(line) + "\\n")
    if event == "start" and sum(1 for _ in open(os.environ["PROBE_LOG"])) > 6:
        os._exit(99)  # a re-execution loop

_report("start")
atexit.register(_report, "exit")
sys.addaudithook(lambda event, args: _report("exec") if event == "os.exec" else None)
{extra}"""
_OPTIONS = ["-O", "-X", "kvpage_probe=yes", "-W", "ignore::FutureWarning"]


def _reporter(source: str, extra: str = "") -> str:
    return _REPORTER.format(source=source, extra=extra)


def _run(
    tmp_path: Path, command: list[str], cwd: Path | None = None, stdin: str | None = None,
    **env: str,
) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]]:
    """``command`` in a clean environment (HOME under ``tmp_path``); its reports."""
    log = tmp_path / "probe.jsonl"
    log.unlink(missing_ok=True)
    environ = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path),
               "PROBE_LOG": str(log), **env}
    done = subprocess.run(command, cwd=cwd or tmp_path, env=environ, input=stdin,
                          capture_output=True, text=True, timeout=120)
    reports = [json.loads(line) for line in log.read_text().splitlines()] \
        if log.exists() else []
    return done, reports


def _site(tmp_path: Path, text: str) -> Path:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(text)
    return site


@needs_tunable
def test_options_and_search_path_survive_the_reexecution(tmp_path: Path) -> None:
    """``python -O -X .. -W .. -m kvpage.cli`` from a directory with its own kvpage
    (another checkout): the second process has the same flags, finds the same kvpage,
    and the user's GLIBC_TUNABLES is merged."""
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    (checkout / "kvpage").symlink_to(Path(kvpage.__file__).parent, target_is_directory=True)
    site = _site(tmp_path, _reporter("site"))
    done, reports = _run(tmp_path, [sys.executable, *_OPTIONS, "-m", "kvpage.cli", "--help"],
                         cwd=checkout, PYTHONPATH=str(site),
                         GLIBC_TUNABLES="glibc.malloc.arena_max=2")
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("usage: kvpage") == 1
    assert [r["event"] for r in reports] == ["start", "exec", "start", "exit"], reports
    first, exec_, second, exit_ = reports
    assert exec_["kvpage"] == exit_["kvpage"] == str(checkout / "kvpage" / "__init__.py")
    for report in (first, second):
        assert report["optimize"] == 1
        assert report["xoptions"] == {"kvpage_probe": "yes"}
        assert report["warnoptions"] == ["ignore::FutureWarning"]
    assert first["pid"] == second["pid"]
    assert first["tunables"] == "glibc.malloc.arena_max=2" and first["reexeced"] is None
    assert second["tunables"] == f"glibc.malloc.arena_max=2:{TUNABLE}"
    assert second["reexeced"] == str(checkout / "kvpage")
    assert "imported from" not in done.stderr  # no mismatch warning


@needs_tunable
@pytest.mark.parametrize("wrapper", [[], ["-m", "cProfile", "-o", "profile.out"]])
def test_isolated_mode_survives_the_reexecution(tmp_path: Path, wrapper: list[str]) -> None:
    """``python -I [-m cProfile] launcher.py``: the second process is isolated too (a
    ``sitecustomize`` on ``PYTHONPATH`` never runs), runs the same launcher (under
    cProfile, which writes its profile in the second process only) and kvpage."""
    site = _site(tmp_path, _reporter("site"))
    launcher = tmp_path / "launcher.py"
    launcher.write_text(_reporter("launcher", "from kvpage.cli import main\nsys.exit(main())\n"))
    command = [sys.executable, "-I", *_OPTIONS, *wrapper, str(launcher), "--help"]
    done, reports = _run(tmp_path, command, PYTHONPATH=str(site))
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("usage: kvpage") == 1
    assert [r["source"] for r in reports] == ["launcher"] * 4, reports  # never "site"
    assert [r["event"] for r in reports] == ["start", "exec", "start", "exit"]
    first, exec_, second, exit_ = reports
    assert second["tunables"] == TUNABLE and second["reexeced"] == PACKAGE_DIR
    for report in (first, second):
        assert report["isolated"] == 1 and report["optimize"] == 1
        assert report["xoptions"] == {"kvpage_probe": "yes"}
        assert report["warnoptions"] == ["ignore::FutureWarning"]
    assert exec_["kvpage"] == exit_["kvpage"] == kvpage.__file__
    assert (tmp_path / "profile.out").exists() == bool(wrapper)


@needs_tunable
def test_isolated_kvpage_cli_runs_no_sitecustomize(tmp_path: Path) -> None:
    """``python -I -m kvpage.cli``: the re-executed process is isolated too."""
    site = _site(tmp_path, _reporter("site"))
    done, reports = _run(tmp_path, [sys.executable, "-I", "-m", "kvpage.cli", "--help"],
                         PYTHONPATH=str(site))
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("usage: kvpage") == 1
    assert reports == []


@needs_tunable
def test_at_most_once_when_the_environment_drops_glibc_tunables(tmp_path: Path) -> None:
    drop = "os.environ.pop('GLIBC_TUNABLES', None)  # as an environment may\n"
    site = _site(tmp_path, _reporter("site", drop))
    done, reports = _run(tmp_path, [sys.executable, "-m", "kvpage.cli", "--help"],
                         PYTHONPATH=str(site))
    assert done.returncode == 0, done.stderr
    assert [r["event"] for r in reports] == ["start", "exec", "start", "exit"], reports


@needs_tunable
def test_what_is_not_replayed_runs_on_as_it_is(tmp_path: Path) -> None:
    """A program read from stdin, and any command with KVPAGE_HUGE_PAGES=0, run once;
    ``python -c`` (how ``kvpage bench vs-llama-cpp`` starts its server) is replayed."""
    site = _site(tmp_path, _reporter("site"))
    launch = "import sys; from kvpage.cli import main; sys.exit(main())"
    done, reports = _run(tmp_path, [sys.executable, "-", "--help"], stdin=launch,
                         PYTHONPATH=str(site))
    assert done.returncode == 0 and "usage: kvpage" in done.stdout, done.stderr
    assert [r["event"] for r in reports] == ["start", "exit"]
    done, reports = _run(tmp_path, [sys.executable, "-m", "kvpage.cli", "--help"],
                         PYTHONPATH=str(site), KVPAGE_HUGE_PAGES="0")
    assert done.returncode == 0, done.stderr
    assert [r["event"] for r in reports] == ["start", "exit"]
    done, reports = _run(tmp_path, [sys.executable, "-c", launch, "--help"],
                         PYTHONPATH=str(site))
    assert done.returncode == 0, done.stderr
    assert [r["event"] for r in reports] == ["start", "exec", "start", "exit"]
