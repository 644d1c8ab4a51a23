"""Where the benchmarks may send load: a free port and the loopback-only rule.

``kvpage bench serve`` (and the load test) load only servers on this machine
unless the user passes the tool's override flag; ``kvpage bench startup`` and the
test harness bind their servers to a free port on 127.0.0.1.
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlparse


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def is_loopback_url(url: str) -> bool:
    """Whether ``url`` names this machine (localhost or a loopback address)."""
    host = urlparse(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_loopback(url: str, override: str | None = None) -> None:
    """ValueError unless ``url`` names this machine: the benchmarks load only loopback
    servers unless the user passes ``override`` (a flag name), if the tool has one."""
    if is_loopback_url(url):
        return
    host = urlparse(url).hostname or ""
    hint = f"; pass {override} to load another machine" if override else ""
    raise ValueError(f"refusing to load {url!r}: {host!r} is not a loopback address{hint}")

