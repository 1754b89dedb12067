"""``minirad serve``: the OpenAI-compatible HTTP server. ``protocol.py`` holds the request models
and error bodies, ``metrics.py`` the Prometheus metrics vLLM names, ``api_server.py`` the routes
and the server's life; the engine thread behind it is :mod:`minirad.engine.async_llm_engine`.
What each endpoint takes and answers: ``docs/serving.md``."""
