"""How requests come in: the ``minirad`` command (``cli.py``, ``argtypes.py``), the prompt and
image checks every front end shares (``chat_utils.py``), and the OpenAI-compatible HTTP server
(``openai/``)."""
