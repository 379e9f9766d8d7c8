"""Tasks, tokenizer, rewards, the supervised warm-up and held-out evaluation.

Modules: ``tokenizer`` (character tokenizer in the HF format), ``tasks`` (reasoning-gym prompt
sets), ``rewards`` (``score(task, completion)``), ``jsonl`` (``{"prompt","answer"}`` rows with a
math-verify reward), ``warmup`` (``moerl warmup``), ``evaluate`` (held-out mean reward).

tiny_recipe — the setting proven, by experiment on one CPU core, to make the tiny policy learn:

* task: reasoning-gym ``spell_backward`` with ``min_word_len=3, max_word_len=6``; compact prompt
  ``<bos>word=`` (e.g. ``leally=``), completion ``yllael<eos>``; reward = the dataset's own
  ``score_answer`` (1.0 exact, else 1/len per matching leading position, so it is dense).
  2000 training prompts and 200 held-out prompts, disjoint by text, from seed 0.
* model: Qwen3-MoE, vocab 100 (characters), hidden 64, 2 layers, 4 query heads of dim 16
  (kv 2 or 4), 8 experts of width 32..128, top-2 with renormalised weights; ~0.2-0.4 M params.
* warm-up (``moerl warmup``): 150 AdamW steps (betas 0.9/0.98, no weight decay), batch 64,
  peak lr 3e-3 with 20 linear warm-up steps then cosine to 10%, grad clip 1.0, loss on the
  answer and ``<eos>`` tokens only: ~13 s on one core. Held-out mean reward after it:
  sampled (T=1) 0.35-0.57, greedy 0.55-0.80 over 7 seeds — well below the ceiling.
* GRPO: group size 8, 8 groups per step, temperature 1.0, max 8 new tokens, advantages
  (r - mean) / (std + 1e-4) per group, token-mean clipped loss (eps 0.2 / 0.28), one optimizer
  step per batch, AdamW lr 4e-4 (3e-4..6e-4 all work) with betas 0.9/0.99, no weight decay,
  10 steps of linear lr warm-up (without it the first Adam steps knock the reward down), grad
  clip 1.0. Held-out sampled mean reward rises +15 to +23 points in 400 steps (7 seeds;
  +10..+13 after 200 steps); the synchronous prototype took ~35 s of one core for 400 steps.
  Greedy reward rises too, or stays flat.
"""
