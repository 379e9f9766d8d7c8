"""Batched autoregressive sampling with a KV cache, for the built-in engine.

One call generates completions for a batch of prompts of different lengths and with different
sampling settings per row:

- prompts are left-padded into one ``[B, L]`` batch; the attention mask hides the padding and
  position ids count only real tokens, so each row computes what it would compute alone;
- one prefill forward fills a ``transformers.DynamicCache``, then one forward per new token;
- rows that finish (a stop token or their own ``max_new_tokens``) leave the batch
  (``DynamicCache.batch_select_indices``) so the rest do not pay for them;
- new rows can join a running batch between decode steps (`DecodeBatch.add`: continuous
  batching, as in Orca, Yu et al. 2022, OSDI), so a request need not wait for the batch
  before it to finish;
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
        finish_reason: "stop" (a stop/EOS token), "length" (max_new_tokens reached) or "abort"
            (ended by /abort_request or a pause in mode abort: the tokens so far).
        matched_stop: the stop token id when finish_reason is "stop", else None.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    matched_stop: int | None = None
    # finish_reason "abort": SGLang's finish_reason object of the abort (app/engine/scheduler.py
    # ABORT_RUNNING / ABORT_WAITING), else None.
    abort: dict | None = None
    # With a RoutingCapture: the expert ids of every token fed through the model, ``[P + C - 1,
    # layers, top_k]`` int32 once finished (parts of it while the row is live).
    routed_experts: torch.Tensor | list[torch.Tensor] | None = None


class RoutingCapture:
    """The expert ids each MoE router of a transformers model chose in its last forward.

    A forward hook on every decoder layer's ``mlp.gate`` (Qwen3-MoE's ``Qwen3MoeTopKRouter`` and
    DeepSeek-V3's ``DeepseekV3TopkRouter`` in transformers 5 return ``(logits, weights,
    indices)``, indices ``[tokens, top_k]``) keeps the indices. `take` returns them for the
    whole batch as SGLang reports routed experts: one row per layer of the model, zeros for
    layers without a router (dense MLP layers), int32 (SGLang ``state_capturer/base.py``).

    Raises:
        ValueError: the model has no router this class recognises.
    """

    def __init__(self, model: torch.nn.Module):
        layers = model.model.layers
        self.num_layers = len(layers)
        self.top_k = int(model.config.num_experts_per_tok)
        self._out: dict[int, torch.Tensor] = {}
        hooked = 0
        for i, layer in enumerate(layers):
            gate = getattr(getattr(layer, "mlp", None), "gate", None)
            if isinstance(gate, torch.nn.Module):
                gate.register_forward_hook(self._hook(i))
                hooked += 1
        if not hooked:
            raise ValueError(f"{type(model).__name__}: no decoder layer has an mlp.gate router to capture")

    def _hook(self, layer: int):
        def keep(module, args, out):
            if not (isinstance(out, tuple) and len(out) == 3):
                raise ValueError(f"layer {layer} mlp.gate returned {type(out).__name__}, expected (logits, weights, indices)")
            self._out[layer] = out[2]
        return keep

    def take(self, batch: int, seq: int) -> torch.Tensor:
        """The ids of the last forward over a ``[batch, seq]`` input: ``[batch, seq, layers,
        top_k]`` int32 on the CPU; cleared afterwards."""
        ids = torch.zeros((batch, seq, self.num_layers, self.top_k), dtype=torch.int32)
        for layer, idx in self._out.items():
            ids[:, :, layer] = idx.reshape(batch, seq, self.top_k).to("cpu", torch.int32)
        self._out.clear()
        return ids


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


def _pad_cache_left(cache: DynamicCache, n: int) -> None:
    """Prepend ``n`` zero positions to every layer's keys/values (masked out by the caller)."""
    if n <= 0:
        return
    for layer in cache.layers:
        k, v = layer.keys, layer.values
        layer.keys = torch.cat([k.new_zeros(*k.shape[:-2], n, k.shape[-1]), k], dim=-2)
        layer.values = torch.cat([v.new_zeros(*v.shape[:-2], n, v.shape[-1]), v], dim=-2)


def _crop_cache_left(cache: DynamicCache, n: int) -> None:
    """Drop the first ``n`` positions of every layer (columns that are padding for every row)."""
    if n <= 0:
        return
    for layer in cache.layers:
        layer.keys = layer.keys[..., n:, :]
        layer.values = layer.values[..., n:, :]


def _cat_caches(a: DynamicCache, b: DynamicCache) -> None:
    """Append the rows of ``b`` to ``a`` (same sequence length), layer by layer, in place."""
    for la, lb in zip(a.layers, b.layers):
        la.keys = torch.cat([la.keys, lb.keys], dim=0)
        la.values = torch.cat([la.values, lb.values], dim=0)


class DecodeBatch:
    """Sequences decoded together; new ones may join between steps (continuous batching).

    Each row holds one pending token (sampled, not yet in the KV cache). `add` prefills new
    rows in one forward pass and merges their cache into the batch's: the shorter cache is
    left-padded with masked zero positions, which is exact because attention ignores masked
    positions and rotary positions come from per-row ``position_ids``, not from columns.
    `step` feeds every pending token through one forward pass and samples the next. Finished
    rows leave the batch at once, and columns that are padding for every remaining row are
    cropped, so the cache stays as long as the longest live row.

    Only the KV cache layout of ``transformers.DynamicCache`` with full-attention layers
    (``layers[i].keys/values`` of shape ``[B, heads, S, head_dim]``) is assumed.

    Args:
        model: a causal LM in eval mode (see `generate`).
        pad_id: token id used for left padding.
        eos_ids: the model's end-of-sequence ids (stop unless a row's ``ignore_eos``).
        generator: optional torch.Generator on the model's device.
        capture: a `RoutingCapture` on ``model``: every completion then carries the expert ids
            of the tokens it fed through the model (``Completion.routed_experts``).
    """

    def __init__(self, model: torch.nn.Module, *, pad_id: int, eos_ids: list[int],
                 generator: torch.Generator | None = None, capture: RoutingCapture | None = None):
        self.model = model
        self.capture = capture
        self.pad_id = pad_id
        self.eos_ids = set(eos_ids)
        self.generator = generator
        self.device = next(model.parameters()).device
        self.cache_kw = cache_kwarg(model)
        self.cache: DynamicCache | None = None
        self.mask = torch.zeros((0, 0), dtype=torch.long, device=self.device)  # [B, S] over the cache
        self.next_pos = torch.zeros(0, dtype=torch.long, device=self.device)  # [B] position of the pending token
        self.pending = torch.zeros(0, dtype=torch.long, device=self.device)  # [B] sampled, not yet fed
        self.temperature = torch.zeros(0, dtype=torch.float32, device=self.device)
        self.top_p = torch.zeros(0, dtype=torch.float32, device=self.device)
        self.rows: list[tuple[object, SamplingParams, set[int], Completion]] = []
        # Rows that end with their next token (finish_reason abort), as SGLang ends a running
        # request it aborts: ``req.to_finish``, one more decode pass (`finish_after_next`).
        self.to_finish: set = set()

    def __len__(self) -> int:
        return len(self.rows)

    @torch.no_grad()
    def add(self, prompts: list[list[int]], params: list[SamplingParams], keys: list) -> list[tuple[object, Completion]]:
        """Prefill ``prompts`` and sample their first token; they join the batch.

        Args:
            prompts: non-empty token id lists; params: one SamplingParams each; keys: any caller
                handle per row, returned with its completion.

        Returns:
            (key, completion) of rows that finished on their first token.

        Raises:
            ValueError: lengths differ or a prompt is empty.
        """
        if not (len(prompts) == len(params) == len(keys)):
            raise ValueError(f"prompts ({len(prompts)}), params ({len(params)}) and keys ({len(keys)}) differ in length")
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompts[{i}] is empty")
        if not prompts:
            return []
        input_ids, mask, positions = left_pad(prompts, self.pad_id, self.device)
        cache = DynamicCache(config=self.model.config)
        logits = self.model(
            input_ids=input_ids, attention_mask=mask, position_ids=positions,
            use_cache=True, logits_to_keep=1, **{self.cache_kw: cache},
        ).logits[:, -1]
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=self.device)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=self.device)
        tokens, logps = sample_next(logits, temperature, top_p, self.generator)
        routed = self.capture.take(*input_ids.shape) if self.capture else None

        if self.cache is None or not self.rows:
            self.cache, self.mask = cache, mask
        else:
            width = max(self.mask.shape[1], mask.shape[1])
            _pad_cache_left(self.cache, width - self.mask.shape[1])
            _pad_cache_left(cache, width - mask.shape[1])
            _cat_caches(self.cache, cache)
            self.mask = torch.cat([
                torch.nn.functional.pad(self.mask, (width - self.mask.shape[1], 0)),
                torch.nn.functional.pad(mask, (width - mask.shape[1], 0)),
            ])
        self.next_pos = torch.cat([self.next_pos, positions[:, -1] + 1])
        self.pending = torch.cat([self.pending, tokens])
        self.temperature = torch.cat([self.temperature, temperature])
        self.top_p = torch.cat([self.top_p, top_p])
        first = len(self.rows)
        width = input_ids.shape[1]
        for i, (key, p) in enumerate(zip(keys, params)):
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_ids)
            # Left padding: row i's own tokens are its last len(prompt) columns.
            parts = None if routed is None else [routed[i, width - len(prompts[i]):]]
            self.rows.append((key, p, stops, Completion([], [], "length", routed_experts=parts)))
        return self._record(tokens, logps, first)

    @torch.no_grad()
    def step(self) -> list[tuple[object, Completion]]:
        """Decode one token for every row; returns (key, completion) of rows that finished."""
        if not self.rows:
            return []
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        logits = self.model(
            input_ids=self.pending[:, None], attention_mask=self.mask, position_ids=self.next_pos[:, None],
            use_cache=True, **{self.cache_kw: self.cache},
        ).logits[:, -1]
        self.next_pos = self.next_pos + 1
        tokens, logps = sample_next(logits, self.temperature, self.top_p, self.generator)
        self.pending = tokens
        if self.capture:
            routed = self.capture.take(len(self.rows), 1)
            for r, (_, _, _, out) in enumerate(self.rows):
                out.routed_experts.append(routed[r])
        return self._record(tokens, logps, 0)

    def finish_after_next(self, keys) -> None:
        """End the rows ``keys`` after their next token with finish_reason abort, whatever
        that token is (SGLang ``Req.update_finish_state`` checks ``to_finish`` first)."""
        self.to_finish |= set(keys) & {key for key, _, _, _ in self.rows}

    def take_all(self) -> list[tuple[object, Completion]]:
        """Remove every row (pause ``abort`` / ``retract``): (key, partial completion) per row,
        each with at least one token; the batch is empty afterwards."""
        rows = [(key, _finalize(out)) for key, _, _, out in self.rows]
        self.rows = []
        self.to_finish = set()
        self.cache = None
        self.mask = self.mask[:0, :0]
        self.next_pos, self.pending = self.next_pos[:0], self.pending[:0]
        self.temperature, self.top_p = self.temperature[:0], self.top_p[:0]
        return rows

    def _record(self, tokens: torch.Tensor, logps: torch.Tensor, first: int) -> list[tuple[object, Completion]]:
        """Append sampled tokens to rows ``first..``; remove finished rows from the batch."""
        done, keep = [], list(range(first))
        for r, (tok, lp) in enumerate(zip(tokens.tolist(), logps.tolist()), start=first):
            key, p, stops, out = self.rows[r]
            out.token_ids.append(tok)
            out.logprobs.append(lp)
            if key in self.to_finish:
                self.to_finish.discard(key)
                out.finish_reason = "abort"
                done.append((key, _finalize(out)))
            elif tok in stops:
                out.finish_reason, out.matched_stop = "stop", tok
                done.append((key, _finalize(out)))
            elif len(out.token_ids) >= p.max_new_tokens:
                done.append((key, _finalize(out)))
            else:
                keep.append(r)
        if len(keep) < len(self.rows):
            idx = torch.tensor(keep, dtype=torch.long, device=self.device)
            self.cache.batch_select_indices(idx)
            self.mask, self.next_pos, self.pending = self.mask[idx], self.next_pos[idx], self.pending[idx]
            self.temperature, self.top_p = self.temperature[idx], self.top_p[idx]
            self.rows = [self.rows[r] for r in keep]
            if self.rows:
                # Columns that are padding for every remaining row need not be attended to.
                live = self.mask.any(dim=0).nonzero()
                lead = int(live[0]) if len(live) else 0
                if lead:
                    _crop_cache_left(self.cache, lead)
                    self.mask = self.mask[:, lead:]
        return done


def _finalize(out: Completion) -> Completion:
    """Join a row's routed-expert parts into one ``[fed tokens, layers, top_k]`` tensor."""
    if isinstance(out.routed_experts, list):
        out.routed_experts = torch.cat(out.routed_experts)
    return out


def generate(
    model: torch.nn.Module,
    prompts: list[list[int]],
    params: list[SamplingParams],
    *,
    pad_id: int,
    eos_ids: list[int],
    generator: torch.Generator | None = None,
) -> list[Completion]:
    """Generate one completion per prompt, all rows in one batch (a `DecodeBatch` run to the end).

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
    batch = DecodeBatch(model, pad_id=pad_id, eos_ids=eos_ids, generator=generator)
    out: list[Completion | None] = [None] * len(prompts)
    for i, c in batch.add(prompts, params, list(range(len(prompts)))):
        out[i] = c
    while len(batch):
        for i, c in batch.step():
            out[i] = c
    return out
