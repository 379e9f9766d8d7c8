"""Rollout: the rollout worker (worker.py), the SGLang HTTP client it uses (engine_client.py),
the engine command lines per engine profile (engine_args.py), the engine's pause-aware probe
(probe.py), and the built-in engine that serves the same API subset on CPU or GPU
(engine_server.py, sampler.py)."""
