"""LoRA adapters in the engine: several resident at once, mixed within one step.

* :mod:`.request`: :class:`LoRARequest` (vLLM's name), which adapter a request uses;
* :mod:`.adapter`: :class:`LoRAAdapter` and the PEFT-format loader;
* :mod:`.stacks`: the runner's adapter stacks in the params tree and each step's
  per-token slots;
* :mod:`.slots`: which adapter sits in which slot (the engine's), pinned while running.

Dependencies point one way: ``request`` <- ``adapter`` <- ``stacks`` <- ``slots``.
"""

from kvpage.lora.adapter import LoRAAdapter, load_peft_adapter
from kvpage.lora.request import LoRARequest

__all__ = ["LoRAAdapter", "LoRARequest", "load_peft_adapter"]
