"""The built-in engine, the server side of the engine boundary (SGLang 0.5.23's native HTTP API
subset that rollout workers use): routes and CLI (server.py), the batching scheduler
(scheduler.py), the checkpoint loader (load.py), the decode batch and sampling (sampler.py), and
the weight-update group's receive (receive.py). It never imports app/rollout/."""
