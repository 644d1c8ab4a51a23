"""What a request constrains its output to: vLLM's ``StructuredOutputsParams`` (and its
older name ``GuidedDecodingParams``), validated.

Exactly one of ``json`` (a JSON schema, as a dict or JSON text), ``regex``, ``choice``
(a list of strings), ``grammar`` (llguidance's Lark syntax) or ``json_object=True``
(any JSON object) is set. Invalid values raise ``ValueError`` naming the field.
"""

from __future__ import annotations

import json as jsonlib
from dataclasses import dataclass
from typing import Any

MAX_SPEC_CHARS = 1 << 20
"""Largest schema / regex / grammar text accepted (a bound on compile memory)."""

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(slots=True, frozen=True)
class StructuredOutputsParams:
    """One structured-output constraint (vLLM's field names)."""

    json: str | dict[str, Any] | bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar or "
                f"json_object, got {given or 'none'}"
            )
        kind = given[0]
        if kind == "json" and not isinstance(self.json, str | dict | bool):
            raise ValueError(f"json must be a JSON schema (dict or str), got {self.json!r}")
        if kind == "json" and isinstance(self.json, str):
            try:
                jsonlib.loads(self.json)
            except ValueError as err:
                raise ValueError(f"json: the schema is not valid JSON: {err}") from None
        if kind in ("regex", "grammar") and not isinstance(getattr(self, kind), str):
            raise ValueError(f"{kind} must be a string, got {getattr(self, kind)!r}")
        if kind == "choice" and (
            not isinstance(self.choice, list | tuple)
            or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError(f"choice must be a non-empty list of non-empty strings, "
                             f"got {self.choice!r}")
        if kind == "json_object" and self.json_object is not True:
            raise ValueError(f"json_object must be True, got {self.json_object!r}")
        if len(self.spec()[1]) > MAX_SPEC_CHARS:
            raise ValueError(f"{kind} is longer than {MAX_SPEC_CHARS} characters")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def spec(self) -> tuple[str, str]:
        """``(kind, text)`` as the Rust core compiles it (``choice`` as a JSON list)."""
        kind = self.kind
        if kind == "json":
            value = self.json
            return kind, value if isinstance(value, str) else jsonlib.dumps(value)
        if kind == "choice":
            return kind, jsonlib.dumps(list(self.choice or ()))
        if kind == "json_object":
            return kind, ""
        return kind, str(getattr(self, kind))

    @classmethod
    def coerce(cls, value: Any, field: str) -> StructuredOutputsParams | None:
        """``value`` as params: an instance, a dict of its fields, or None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - set(KINDS)
            if unknown:
                raise ValueError(f"{field} has unknown fields {sorted(unknown)}; "
                                 f"expected some of {list(KINDS)}")
            return cls(**value)
        raise ValueError(f"{field} must be StructuredOutputsParams or a dict, got {value!r}")


GuidedDecodingParams = StructuredOutputsParams
"""vLLM's older name (``SamplingParams(guided_decoding=...)``)."""
