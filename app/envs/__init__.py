"""Tasks, tokenizer, rewards, the supervised warm-up and held-out evaluation.

Modules: ``tokenizer`` (character tokenizer in the HF format), ``tasks`` (reasoning-gym prompt
sets), ``rewards`` (``score(task, completion)``), ``jsonl`` (``{"prompt","answer"}`` rows with a
math-verify reward), ``warmup`` (``moerl warmup``), ``evaluate`` (held-out mean reward).
Multi-turn environments (issue 16): ``environments`` (the OpenEnv environments ``spell-retry``
and ``calculator``), ``calculator`` (the tool: integer arithmetic, no code runs),
``openenv_server`` (``moerl env``), ``env_client`` (the rollout worker's client of OpenEnv's
WebSocket protocol), ``chat`` (messages to token ids: chat templates, or plain text),
``episodes_local`` (episodes in process: warm-up demonstrations, held-out evaluation).
Environments of the user's (issue 30): ``wire`` (which action and observation fields carry text,
from the server's ``/schema``), ``episodes_remote`` (their demonstrations and held-out episodes,
played against their server).

tiny_recipe — the setting proven, by experiment on one CPU thread, to make the tiny policy learn
(scratch synchronous GRPO prototype; the real trainer is app/trainer):

* task: reasoning-gym ``spell_backward`` with ``min_word_len=3, max_word_len=6``; compact prompt
  ``<bos>word=`` (e.g. ``leally=``), completion ``yllael<eos>`` (<= 7 tokens, so
  ``rollout.max_new_tokens: 8``); reward = the dataset's own ``score_answer`` (1.0 exact, else
  1/len per letter in its place, so it is dense). 2000 training and 200 held-out prompts,
  disjoint by text, from seed 0 (``TaskConfig`` defaults).
* model: the ``tiny-qwen3-moe`` preset of app/model/config.py as it is: vocab 100 (characters),
  hidden 64, 2 layers, 4 query / 2 kv heads of dim 16, 8 experts of width 32, top-2 with
  renormalised weights, untied embeddings: 137 k parameters. (Stock-transformers variants with
  experts of width 128 and 4 or 8 experts behaved the same or better.)
* warm-up (``moerl warmup``, ``TaskConfig.warmup_*``): 150 AdamW steps (betas 0.9/0.98, no weight
  decay), batch 64, peak lr 3e-3 with 20 linear warm-up steps then cosine to 10%, grad clip 1.0,
  loss on the answer and ``<eos>`` tokens only: ~9-13 s on one thread. Held-out mean reward after
  it, over 5 seeds: sampled (T=1) 0.41-0.69, greedy 0.60-0.88.
* GRPO: group size 8, 8 groups per step, temperature 1.0, advantages (r - mean) / (std + 1e-4)
  per group, token-mean clipped loss (eps 0.2 / 0.28), one optimizer step per batch, AdamW
  lr 4e-4 with betas 0.9/0.99, no weight decay, 10 steps of linear lr warm-up (without it the
  first Adam steps knock the reward down by up to 10 points), grad clip 1.0.
  Held-out sampled mean reward, 5 seeds: +8..+12 points (mean +10.4) after 200 steps and
  +15..+23 (mean +18.4) after 400 steps; lr 6e-4 gave a mean of +17.4 at 400, lr 1e-3 +14.7.
  400 steps took 35-45 s of one thread in the prototype (12 800 completions). Greedy reward
  rises too, or stays flat. With rollouts one policy version stale (as ``max_staleness: 1``
  allows) and truncated importance sampling (cap 2), the gain was the same: the ``moerl warmup``
  checkpoint of seed 0 went 0.461 -> 0.583 (200 steps) -> 0.654 (400 steps), against 0.539 and
  0.626 on-policy.
* what did not work: chain_sum (1-digit, 2-3 terms): RL raised the reward on training prompts
  only, held-out reward stayed flat (lr <= 1e-4) or fell (lr 5e-4). Label smoothing in the
  warm-up was not adopted: similar sampled gains, but greedy reward fell.
"""
