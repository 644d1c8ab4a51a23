"""Several replicas' Prometheus texts as one: :func:`merge_metrics`.

Each sample gains a ``replica="<id>"`` label, so series of different replicas stay
apart; each metric family's ``# HELP`` / ``# TYPE`` lines appear once, before its first
sample. The ingress (:mod:`kvpage.ray.ingress`) answers ``/metrics`` with it, so one
scrape of the application sees every replica.
"""

from __future__ import annotations

import re

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?( .*)$")


def with_replica_label(line: str, replica: str) -> str:
    """One sample line with ``replica="<replica>"`` added to its labels."""
    match = _SAMPLE.match(line)
    if match is None:
        return line
    name, labels, rest = match.groups()
    label = f'replica="{replica}"'
    labels = "{" + label + "}" if not labels or labels == "{}" else \
        labels[:-1] + "," + label + "}"
    return f"{name}{labels}{rest}"


def merge_metrics(texts: dict[str, str]) -> str:
    """``{replica id: its /metrics text}`` as one exposition (module docs)."""
    families: dict[str, list[str]] = {}  # family name -> its comment lines, then samples
    order: list[str] = []
    for replica, text in sorted(texts.items()):
        family = ""
        for line in text.splitlines():
            if not line:
                continue
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                family = line.split(" ", 3)[2]
                if family not in families:
                    families[family] = []
                    order.append(family)
                if line not in families[family]:
                    families[family].append(line)
                continue
            if line.startswith("#"):
                continue
            families.setdefault(family, [])
            if family not in order:
                order.append(family)
            families[family].append(with_replica_label(line, replica))
    return "\n".join(line for family in order for line in families[family]) + "\n"
