"""Which LoRA adapter a request runs under: :class:`LoRARequest`, with vLLM's fields."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, a positive integer id unique per adapter, and the PEFT
    directory it loads from (``adapter_config.json`` + ``adapter_model.safetensors``).

    Requests with the same ``lora_int_id`` share one resident copy of the adapter, and
    their prompts share the prefix cache with each other only (never with the base
    model's or another adapter's).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer; got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")

    @classmethod
    def parse_modules(cls, specs: list[str] | tuple[str, ...]) -> list[LoRARequest]:
        """``--lora-modules``: ``name=path`` or JSON ``{"name": ..., "path": ...}`` each,
        numbered 1, 2, ... in order; ValueError names a malformed or repeated one."""
        import json

        out: list[LoRARequest] = []
        for spec in specs:
            if spec.lstrip().startswith("{"):
                try:
                    item = json.loads(spec)
                    name, path = item["name"], item["path"]
                except (ValueError, KeyError, TypeError) as e:
                    raise ValueError(f"--lora-modules {spec!r}: a JSON module needs "
                                     f"\"name\" and \"path\" ({e})") from None
            else:
                name, sep, path = spec.partition("=")
                if not sep or not name or not path:
                    raise ValueError(f"--lora-modules {spec!r}: expected name=path")
            if any(r.lora_name == name for r in out):
                raise ValueError(f"--lora-modules: adapter name {name!r} given twice")
            out.append(cls(str(name), len(out) + 1, str(path)))
        return out

    @property
    def cache_salt(self) -> str:
        """The prefix-cache salt of this adapter's requests (KV differs per adapter)."""
        return f"lora:{self.lora_int_id}"
