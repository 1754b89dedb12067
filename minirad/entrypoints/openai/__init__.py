"""``minirad serve``: the OpenAI-compatible HTTP server.

``protocol.py`` holds the request models and error bodies, ``intake.py`` the body limits checked
before parsing, ``serving.py`` what each endpoint does, ``metrics.py`` the Prometheus metrics
vLLM names, and ``api_server.py`` the routes, the errors' answers and the server's life. The
engine thread behind it is :mod:`minirad.engine.async_llm_engine`. What each endpoint takes and
answers: ``docs/serving.md``.
"""
