"""The real engines beside ours: vLLM's venv (``vllm_env.py``), its OpenAI server as a context
manager (``vllm_server.py``), and the subprocess plumbing both use (``server_process.py``)."""
