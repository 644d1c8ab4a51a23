"""Seeded random JSON schemas for the structured-output tests: nested objects, arrays,
enums, strings, integers and numbers with ranges, required fields.

Every schema bounds its output: strings have ``maxLength``, arrays ``maxItems``,
objects list their properties with ``additionalProperties: false``, so a sampler that
follows the grammar's masks must terminate (the engine emits JSON without free
whitespace). Numbers may have long fractions; tests give them room (``max_tokens``).
"""

from __future__ import annotations

import random
from typing import Any

_WORDS = ["id", "name", "age", "tags", "score", "ok", "kind", "items", "meta", "x", "level"]


def _leaf(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["string", "integer", "number", "boolean", "enum", "null"])
    if kind == "string":
        low = rng.randint(0, 3)
        return {"type": "string", "minLength": low, "maxLength": low + rng.randint(0, 6)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "number":
        low = rng.uniform(-10, 10)
        return {"type": "number", "minimum": round(low, 2), "maximum": round(low + 20, 2)}
    if kind == "enum":
        pool: list[Any] = ["red", "green", "blue", 1, 2.5, True, None, "a b"]
        return {"enum": rng.sample(pool, rng.randint(1, 4))}
    return {"type": kind}


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """An object schema; nested objects and arrays down to depth 2."""
    names = rng.sample(_WORDS, rng.randint(1, 4))
    properties: dict[str, Any] = {}
    for name in names:
        roll = rng.random()
        if depth < 2 and roll < 0.2:
            properties[name] = random_schema(rng, depth + 1)
        elif depth < 2 and roll < 0.4:
            item = random_schema(rng, depth + 1) if rng.random() < 0.3 else _leaf(rng)
            properties[name] = {
                "type": "array",
                "items": item,
                "minItems": rng.randint(0, 1),
                "maxItems": rng.randint(1, 3),
            }
        else:
            properties[name] = _leaf(rng)
    required = [n for n in names if rng.random() < 0.7]
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }
