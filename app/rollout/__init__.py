"""Rollout: the rollout worker (worker.py), the SGLang HTTP client it uses (engine_client.py),
and the built-in engine that serves the same API subset on CPU or GPU (engine_server.py,
sampler.py)."""
