"""Batched autoregressive sampling with a KV cache, for the built-in engine.

One call generates completions for a batch of prompts of different lengths and with different
sampling settings per row:

- prompts are left-padded into one ``[B, L]`` batch; the attention mask hides the padding and
  position ids count only real tokens, so each row computes what it would compute alone;
- one prefill forward fills a ``transformers.DynamicCache``, then one forward per new token;
- rows that finish (a stop token or their own ``max_new_tokens``) leave the batch
  (``DynamicCache.batch_select_indices``) so the rest do not pay for them;
- temperature and nucleus (top-p) sampling per row, greedy when ``temperature == 0``.

Logprobs: for each sampled token we report ``log_softmax(logits / temperature)`` at that token,
i.e. the log-probability under the temperature-scaled distribution *before* top-p truncation
(for ``temperature == 0``: ``log_softmax(logits)``). The trainer recomputes its logprobs the same
way (log_softmax of logits / temperature at the completion tokens), so with top_p = 1 the two
agree up to floating-point noise. Top-p follows Holtzman et al. 2020, "The Curious Case of
Neural Text Degeneration" (keep the smallest set of tokens whose probability reaches top_p).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache


@dataclass
class SamplingParams:
    """Sampling settings of one sequence (the subset of SGLang's ``sampling_params`` we use).

    Attributes:
        max_new_tokens: most tokens to generate (>= 1).
        temperature: softmax temperature (> 0), or 0 for greedy decoding.
        top_p: nucleus mass in (0, 1]; 1 keeps the whole vocabulary.
        stop_token_ids: token ids that end the sequence (the stop token is kept in the output).
        ignore_eos: do not stop at the model's EOS ids (stop_token_ids still apply).
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def validate(self, name: str = "sampling_params") -> None:
        """Raise ValueError naming the field of ``name`` that is out of range."""
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"{name}.max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not self.temperature >= 0.0:
            raise ValueError(f"{name}.temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"{name}.top_p must be in (0, 1], got {self.top_p!r}")


@dataclass
class Completion:
    """The output of one sequence.

    Attributes:
        token_ids: generated token ids (the stop token included when finish_reason is "stop").
        logprobs: one float per generated token, see the module docstring.
        finish_reason: "stop" (a stop/EOS token) or "length" (max_new_tokens reached).
        matched_stop: the stop token id when finish_reason is "stop", else None.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    matched_stop: int | None = None


def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device | str = "cpu"):
    """Left-pad token id lists into one batch.

    Returns:
        input_ids ``[B, L]`` int64, attention_mask ``[B, L]`` int64 (1 = real token) and
        position_ids ``[B, L]`` int64 (0 at each row's first real token; 0 on padding).
    """
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        if p:
            input_ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return input_ids.to(device), mask.to(device), positions.to(device)


def sample_next(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row.

    Args:
        logits: ``[B, V]`` float logits of the next token.
        temperature: ``[B]`` float32; 0 means greedy.
        top_p: ``[B]`` float32 in (0, 1].
        generator: optional torch.Generator for reproducible draws.

    Returns:
        tokens ``[B]`` int64 and their logprobs ``[B]`` float32 under
        ``log_softmax(logits / temperature)`` (``log_softmax(logits)`` for greedy rows).
    """
    logits = logits.float()
    greedy = temperature <= 0
    scale = torch.where(greedy, torch.ones_like(temperature), temperature)
    logp = torch.log_softmax(logits / scale[:, None], dim=-1)

    # Nucleus filter on the scaled distribution: drop tokens once the mass before them >= top_p.
    sorted_logp, order = torch.sort(logp, dim=-1, descending=True)
    mass_before = sorted_logp.exp().cumsum(-1) - sorted_logp.exp()
    drop = mass_before >= top_p[:, None]
    drop[:, 0] = False
    sorted_probs = sorted_logp.exp().masked_fill(drop, 0.0)
    pick = torch.multinomial(sorted_probs, 1, generator=generator).squeeze(-1)
    sampled = order.gather(-1, pick[:, None]).squeeze(-1)

    tokens = torch.where(greedy, logits.argmax(-1), sampled)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def cache_kwarg(model: torch.nn.Module) -> str:
    """Name of the KV-cache argument of ``model.forward``: ``cache`` (transformers >= 5.2x) or
    the older ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompts: list[list[int]],
    params: list[SamplingParams],
    *,
    pad_id: int,
    eos_ids: list[int],
    generator: torch.Generator | None = None,
) -> list[Completion]:
    """Generate one completion per prompt, all rows in one batch.

    Args:
        model: a causal LM (transformers ``*ForCausalLM``) in eval mode; its forward must take
            ``input_ids, attention_mask, position_ids, use_cache, logits_to_keep`` and a
            ``DynamicCache`` as ``cache`` or ``past_key_values``.
        prompts: B non-empty lists of token ids (any lengths).
        params: B SamplingParams, one per prompt.
        pad_id: token id used for left padding (never attended to).
        eos_ids: the model's end-of-sequence ids (stop unless ``ignore_eos``).
        generator: optional torch.Generator on the model's device for reproducible sampling.

    Returns:
        B Completions in prompt order.

    Raises:
        ValueError: lengths of prompts and params differ, or a prompt is empty.
    """
    if len(prompts) != len(params):
        raise ValueError(f"prompts ({len(prompts)}) and params ({len(params)}) differ in length")
    if not prompts:
        return []
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompts[{i}] is empty")
    device = next(model.parameters()).device
    input_ids, mask, positions = left_pad(prompts, pad_id, device)
    stops = [set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids)) for p in params]
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)

    out = [Completion([], [], "length") for _ in prompts]
    alive = list(range(len(prompts)))  # original row index of each row still in the batch
    cache = DynamicCache(config=model.config)
    cache_kw = cache_kwarg(model)
    logits = model(
        input_ids=input_ids, attention_mask=mask, position_ids=positions,
        use_cache=True, logits_to_keep=1, **{cache_kw: cache},
    ).logits[:, -1]
    next_pos = positions[:, -1] + 1

    while alive:
        tokens, logps = sample_next(logits, temperature, top_p, generator)
        keep = []
        for row, (tok, lp) in enumerate(zip(tokens.tolist(), logps.tolist())):
            i = alive[row]
            out[i].token_ids.append(tok)
            out[i].logprobs.append(lp)
            if tok in stops[i]:
                out[i].finish_reason, out[i].matched_stop = "stop", tok
            elif len(out[i].token_ids) < params[i].max_new_tokens:
                keep.append(row)
        if not keep:
            break
        if len(keep) < len(alive):
            # Finished rows leave the batch (cache, mask and per-row settings alike).
            idx = torch.tensor(keep, device=device)
            cache.batch_select_indices(idx)
            tokens, mask, next_pos = tokens[idx], mask[idx], next_pos[idx]
            temperature, top_p = temperature[idx], top_p[idx]
            alive = [alive[r] for r in keep]
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        logits = model(
            input_ids=tokens[:, None], attention_mask=mask, position_ids=next_pos[:, None],
            use_cache=True, **{cache_kw: cache},
        ).logits[:, -1]
        next_pos = next_pos + 1
    return out
