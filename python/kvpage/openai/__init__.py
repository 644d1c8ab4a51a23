"""The OpenAI-compatible HTTP front end (``kvpage serve``), one job per module.

* :mod:`~kvpage.openai.app`: ``build_app``, the FastAPI app and its routes;
* :mod:`~kvpage.openai.run`: ``run_server``, uvicorn with a graceful SIGTERM/SIGINT;
* :mod:`~kvpage.openai.protocol`: request bodies, their validation and ``APIError``;
* :mod:`~kvpage.openai.errors`: engine errors and exceptions as OpenAI-style JSON errors;
* :mod:`~kvpage.openai.guard`: the API key and the request-body size limit;
* :mod:`~kvpage.openai.state`: the state behind the routes (models, tokenizer, checks);
* :mod:`~kvpage.openai.generation`: a request added to the engine, one stream per prompt;
* :mod:`~kvpage.openai.streaming`: engine outputs as choice deltas and SSE responses;
* :mod:`~kvpage.openai.respond`: a stream, or the whole answer (499 if the client left);
* :mod:`~kvpage.openai.completions`, :mod:`~kvpage.openai.chat`,
  :mod:`~kvpage.openai.tokenization`: the endpoints;
* :mod:`~kvpage.openai.sse_events`, :mod:`~kvpage.openai.logprobs`: SSE event bytes, and
  logprobs (sampled, ``echo``, ``prompt_logprobs``) in response shapes.

Nothing is imported here: ``kvpage.openai.protocol`` needs no web framework.
"""
