"""The engine: the step loop (``llm_engine``), its asyncio driver (``async_engine``), its
settings (``config``) and its serving metrics (``metrics``)."""
