"""Which adapter sits in which slot of the runner's stacks: the engine's side of LoRA.

Owns :class:`LoRASlots`. A request under a :class:`~kvpage.lora.request.LoRARequest`
pins its adapter's slot from ``add_request`` until its last output (waiting, running or
preempted alike), so a step never runs a row whose slot was rewritten under it. An
adapter not resident is loaded (from disk once; kept in host memory by id) into a free
slot: one never written, else the least recently used slot no live request pins. When
every slot is pinned by live requests of other adapters, the request is refused with
:class:`LoRASlotsFullError` naming ``max_loras`` (the server answers 503, retry later;
vLLM queues it instead, kvpage does not yet).

Invariants: ``pins[slot]`` is the number of live requests mapped to ``slot`` in the
runner's ``slot_of_request``; a slot with pins holds the adapter ``resident`` names.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from kvpage.lora.adapter import LoRAAdapter, load_peft_adapter
from kvpage.lora.request import LoRARequest
from kvpage.lora.stacks import LoRAStacks


class LoRASlotsFullError(RuntimeError):
    """Every adapter slot is pinned by live requests of other adapters: the request was
    not queued; it may be sent again once one of them finishes (the server answers 503)."""


class LoRASlots:
    """Slots ``1..max_loras`` of ``runner``'s stacks, by adapter id."""

    def __init__(self, runner: Any) -> None:
        stacks: LoRAStacks | None = getattr(runner, "lora", None)
        if stacks is None:
            raise ValueError("LoRA needs a runner built with enable_lora")
        self._runner = runner
        self._stacks = stacks
        self._shapes = stacks.shapes(runner.params)
        self.resident: OrderedDict[int, int] = OrderedDict()
        """Adapter id -> slot, least recently used first."""
        self.pins = [0] * (stacks.max_loras + 1)
        self._adapters: dict[int, LoRAAdapter] = {}
        self._names: dict[int, str] = {}
        self._versions: dict[int, int] = {}

    def add_adapter(self, request: LoRARequest, adapter: LoRAAdapter | None = None) -> None:
        """Make ``request``'s adapter known (loaded from its path now, or ``adapter``);
        raises ValueError naming what is wrong with the adapter."""
        known = self._names.get(request.lora_int_id)
        if known is not None and known != request.lora_name:
            raise ValueError(f"lora_int_id {request.lora_int_id} is already adapter "
                             f"{known!r}, not {request.lora_name!r}")
        if request.lora_int_id in self._adapters and adapter is None:
            return
        if adapter is None:
            if not request.lora_path:
                raise ValueError(f"LoRA adapter {request.lora_name!r} has no lora_path")
            adapter = load_peft_adapter(request.lora_path, self._shapes,
                                        self._stacks.max_lora_rank)
        replaced = request.lora_int_id in self._adapters
        self._adapters[request.lora_int_id] = adapter
        self._names[request.lora_int_id] = request.lora_name
        self._versions[request.lora_int_id] = self._versions.get(request.lora_int_id, -1) + 1
        assert replaced or self._versions[request.lora_int_id] == 0
        slot = self.resident.get(request.lora_int_id)
        if slot is not None:  # new weights for a resident adapter: rewrite when unpinned
            if self.pins[slot]:
                raise ValueError(f"LoRA adapter {request.lora_name!r} is in use; its "
                                 "weights cannot change under running requests")
            self._runner.load_lora(slot, adapter)

    def acquire(self, handle: int, request: LoRARequest) -> int:
        """Pin ``request``'s adapter for request ``handle``; returns its slot."""
        self.add_adapter(request)
        adapter_id = request.lora_int_id
        slot = self.resident.get(adapter_id)
        if slot is None:
            slot = self._free_slot(request)
            self._runner.load_lora(slot, self._adapters[adapter_id])
            self.resident[adapter_id] = slot
        self.resident.move_to_end(adapter_id)
        self.pins[slot] += 1
        self._stacks.slot_of_request[handle] = slot
        return slot

    def release(self, handle: int) -> None:
        """Unpin the slot of request ``handle`` (no-op for a request without adapter)."""
        slot = self._stacks.slot_of_request.pop(handle, None)
        if slot is not None:
            self.pins[slot] -= 1
            assert self.pins[slot] >= 0

    def _free_slot(self, request: LoRARequest) -> int:
        used = set(self.resident.values())
        for slot in range(1, len(self.pins)):
            if slot not in used:
                return slot
        for adapter_id, slot in self.resident.items():  # least recently used first
            if not self.pins[slot]:
                del self.resident[adapter_id]
                return slot
        raise LoRASlotsFullError(
            f"cannot run LoRA adapter {request.lora_name!r} now: all max_loras="
            f"{len(self.pins) - 1} adapter slots are in use by live requests of other "
            "adapters; retry when one finishes, or raise max_loras"
        )

    def cache_salt(self, request: LoRARequest) -> str:
        """The prefix-cache salt of ``request``'s adapter as it is now: KV computed
        under earlier weights of the same adapter is never reused."""
        return f"{request.cache_salt}.{self._versions.get(request.lora_int_id, 0)}"

    def names(self) -> dict[int, str]:
        """Known adapter ids and their names."""
        return dict(self._names)
