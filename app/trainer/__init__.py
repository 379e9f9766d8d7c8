"""GRPO trainer: losses (grpo.py), batch collation (batch.py), the trainer (trainer.py, looped by
loop.py, started by train.py) and policy publishing (publish.py). PPO (issue 9) will add its
losses beside grpo.py."""


class TrainingError(RuntimeError):
    """A run-ending condition whose message is meant for the user (printed without traceback):
    no batch in time, too many non-finite steps in a row, a failed publish, a failed rank 0."""
