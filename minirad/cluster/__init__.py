"""Many replicas: which engine's prefix cache a request meets (``routing.py``), and real replicas
behind the real routers, sglang-router and vllm-router (``replicas.py``)."""
