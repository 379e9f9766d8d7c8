"""GRPO trainer: losses (grpo.py), batch collation (batch.py), the training loop (train.py) and
policy publishing (publish.py). PPO (issue 9) will add its losses beside grpo.py."""
