"""The GRPO and PPO trainer: the policy losses (grpo.py), PPO's critic, GAE and value loss
(ppo.py, critic.py), DAPO's dynamic sampling (sampling.py), batch intake and collation (intake.py,
batch.py), the device mesh and sharded models (parallel.py, models.py), one optimizer step
(step.py), the trainer (trainer.py: build, step and loop; started by train.py), training state
(state.py), policy publishing (publish.py) and the network weight push (weight_sync.py)."""


class TrainingError(RuntimeError):
    """A run-ending condition whose message is meant for the user (printed without traceback):
    no batch in time, too many non-finite steps in a row, a failed publish, a failed rank 0."""
