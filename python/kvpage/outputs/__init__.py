"""What generation returns: ``RequestOutput`` / ``CompletionOutput`` (vLLM's shapes,
``request_output``), the streams that build them from sampled tokens (``output_streams``,
``detokenizer``), prompt scoring records (``prompt_logprobs``) and the array outputs of RL
loops (``rollout``)."""

from kvpage.outputs.request_output import (
    CompletionOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
)

__all__ = ["CompletionOutput", "Logprob", "RequestMetrics", "RequestOutput"]
