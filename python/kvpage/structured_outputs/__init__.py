"""Structured outputs: JSON schema, regex, choice and grammar constraints enforced with
token masks computed in the Rust core (llguidance) and applied by the device sampler.

* :mod:`.params`: :class:`StructuredOutputsParams` (alias ``GuidedDecodingParams``).
* :mod:`.vocab`: token byte strings from a Hugging Face tokenizer.
* :mod:`.compiler`: :class:`GrammarCompiler`, compiling off the engine thread.
"""

from kvpage.structured_outputs.params import GuidedDecodingParams, StructuredOutputsParams

__all__ = ["GuidedDecodingParams", "StructuredOutputsParams"]
