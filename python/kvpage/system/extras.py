"""What each optional part of kvpage needs, checked before it starts.

``pip install kvpage`` brings the engine (``LLM``, ``kvpage generate``, the
offline benchmarks); ``pip install 'kvpage[serve]'`` adds what ``kvpage
serve`` and ``kvpage bench serve`` use. Those commands call ``require`` at
startup, so a missing package is one clear error ("install kvpage[serve]")
before the model loads, not a failure at the first request.
"""

from __future__ import annotations

import importlib.util

SERVE_MODULES = {
    # import name -> distribution name
    "fastapi": "fastapi",
    "pydantic": "pydantic",
    "uvicorn": "uvicorn",
    "prometheus_client": "prometheus_client",
    "jinja2": "jinja2",  # chat templates (transformers' apply_chat_template)
}
BENCH_SERVE_MODULES = {"httpx": "httpx"}

RAY_MODULES = {**SERVE_MODULES, "ray": "ray[serve]"}

EXTRAS = {"serve": SERVE_MODULES, "bench-serve": BENCH_SERVE_MODULES, "ray": RAY_MODULES}


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message says what to install."""


def missing(modules: dict[str, str]) -> list[str]:
    """Distribution names of ``modules`` that cannot be imported."""
    return [dist for name, dist in modules.items() if importlib.util.find_spec(name) is None]


def require(what: str, modules: dict[str, str], extra: str = "serve") -> None:
    """``MissingExtraError`` naming the missing packages unless all of
    ``modules`` can be imported."""
    absent = missing(modules)
    if absent:
        raise MissingExtraError(
            f"{what} needs {', '.join(absent)}, which {'is' if len(absent) == 1 else 'are'} "
            f"not installed: install kvpage[{extra}] (pip install 'kvpage[{extra}]')")
