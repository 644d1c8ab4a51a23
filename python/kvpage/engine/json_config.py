"""The settings a flag takes as a JSON object (``--speculative-config``,
``--kv-events-config``): :func:`config_dict` reads a dict or its JSON text and names
what is wrong in a ``ValueError`` (not JSON, not an object, unknown keys)."""

from __future__ import annotations

import json
from typing import Any


def config_dict(value: Any, name: str, known: set[str]) -> dict[str, Any]:
    """``value`` (a dict or its JSON text) as a dict whose keys are all in ``known``."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict or its JSON text, got {type(value).__name__}")
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{name} has unknown keys {unknown}; known keys are {sorted(known)}")
    return value
