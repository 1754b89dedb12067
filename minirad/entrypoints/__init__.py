"""How requests come in: the ``minirad`` command (``cli.py``, one module per subcommand in
``commands/``, argument types in ``argtypes.py``), the prompt and image checks every front end
shares (``chat_utils.py``), and the OpenAI-compatible HTTP server (``openai/``)."""
