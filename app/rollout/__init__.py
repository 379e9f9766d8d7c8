"""Rollout, the worker's side of the engine boundary: the rollout worker (worker.py), the engine's
weights as the worker drives them (weights.py), reward execution (scoring.py), the SGLang HTTP
client (engine_client.py), the engine command lines per engine profile (engine_args.py), the
engine's pause-aware probe (probe.py) and the network-push member (weight_sync.py). The built-in
engine that serves the same API subset is app/engine/."""
