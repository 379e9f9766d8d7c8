"""Token-level loss masks of multi-turn samples: environment tokens get exactly zero gradient.

The check runs the trainer's own path (collate_groups -> the policy's chunked sequence_logprobs
-> grpo_loss with TIS) on the real tiny policy and reads the gradient of the trunk's output at
every position: the final hidden state at position t - 1 reaches the loss only through the
log-probability of token t, so it is exactly zero where token t is the environment's and not
zero where the policy generated it.
"""

from __future__ import annotations

import pytest
import torch

from app.buffer.records import Group, Sample
from app.config import RouterConfig
from app.model.config import tiny_config
from app.model.parallel import EPContext
from app.model.policy import build_policy
from app.trainer.batch import collate_groups
from app.trainer.grpo import grpo_loss


def episode(i: int, turns: list[list[int]], obs: list[list[int]], reward: float) -> Sample:
    """A multi-turn sample: turn, observation, turn, ... with the worker's mask and logprobs."""
    completion, mask, lps = [], [], []
    for k, t in enumerate(turns):
        completion += t
        mask += [1] * len(t)
        lps += [-1.0 - 0.1 * j for j in range(len(t))]
        if k < len(obs):
            completion += obs[k]
            mask += [0] * len(obs[k])
            lps += [0.0] * len(obs[k])
    return Sample(sample_id=f"r/t/{i}/0", task_id="t", index=i, attempt=0, prompt_ids=[1, 20, 21, 22],
                  completion_ids=completion, logprobs=lps, reward=reward, policy_version=0,
                  finish_reason="stop", loss_mask=mask)


@pytest.fixture(scope="module")
def group():
    return Group("t", 0, [
        episode(0, [[30, 31, 2], [40, 2]], [[50, 51, 52]], 1.0),
        episode(1, [[32, 2], [41, 42, 2]], [[53, 54]], 0.0),
        episode(2, [[33, 34, 35, 2]], [], 0.2),  # one turn: no environment tokens
    ])


def test_collate_masks_environment_tokens(group):
    b = collate_groups([group])
    s = group.samples[0]
    p, c = len(s.prompt_ids), len(s.completion_ids)
    assert b.completion_mask[0, p:p + c].tolist() == [float(m) for m in s.loss_mask]
    assert b.completion_mask[0, :p].sum() == 0 and b.completion_mask[0, p + c:].sum() == 0
    # The token-mean denominator counts generated tokens only (3 + 2, 2 + 3, 4).
    assert b.num_tokens == 14
    env = (b.attention_mask > 0) & (b.completion_mask == 0)
    env[:, :4] = False  # prompt
    assert int(env.sum()) == 5 and torch.all(b.rollout_logprobs[env] == 0)


def test_environment_tokens_receive_exactly_zero_gradient(group):
    torch.manual_seed(0)
    model = build_policy(tiny_config("tiny-qwen3-moe"), RouterConfig(), EPContext.local(), seed=0)
    b = collate_groups([group])
    logp, _, hidden = model.sequence_logprobs(b.input_ids, b.attention_mask, b.completion_mask)
    hidden.retain_grad()
    out = grpo_loss(logp, logp.detach() + 0.05, b.advantages, b.completion_mask, denominator=b.num_tokens,
                    rollout_logprobs=b.rollout_logprobs, tis_cap=2.0)
    out.loss.backward()
    g = hidden.grad.abs().sum(-1)  # [B, L]: gradient at the hidden state predicting token t + 1
    predicts_env = (b.completion_mask[:, 1:] == 0) & (b.attention_mask[:, 1:] > 0)
    predicts_model = b.completion_mask[:, 1:] > 0
    assert int(predicts_env.sum()) > 4  # prompt and observation tokens are there to check
    assert torch.all(g[:, :-1][predicts_env] == 0.0)
    assert torch.all(g[:, :-1][predicts_model] > 0.0)
    # And the loss is what a mask-blind loss over the generated tokens alone gives.
    assert float(out.sums["tokens"]) == b.num_tokens


def test_bad_loss_mask_is_refused(group):
    s = group.samples[0]
    bad = Sample(**{**s.to_dict(), "loss_mask": s.loss_mask[:-1]})
    with pytest.raises(ValueError, match="loss_mask has"):
        collate_groups([Group("t", 0, [bad])])
    bad = Sample(**{**s.to_dict(), "loss_mask": [2] * len(s.completion_ids)})
    with pytest.raises(ValueError, match="0 or 1"):
        collate_groups([Group("t", 0, [bad])])
