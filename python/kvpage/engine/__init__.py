"""The engine: the step loop (``llm_engine``, built from one module per stage of a
step: see its docstring), its asyncio driver (``async_engine``, ``request_stream``), its
settings (``config``) and its serving metrics (``metrics``, ``histograms``)."""
