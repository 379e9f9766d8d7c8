"""Messages to token ids for multi-turn episodes: the policy's tokenizer, once per token.

Environments speak messages (``{"role", "content"}``); the engine and the trainer see token ids.
The worker keeps one token sequence per episode: the prompt, then each turn's generated ids as
the engine returned them (never re-tokenized), then the observation's ids, and so on. Only the
observation is tokenized, once, by the policy's tokenizer, and only its ids get loss mask 0.

`ChatRenderer` (a tokenizer with a ``chat_template``): through transformers'
``apply_chat_template``. The prompt is the rendered conversation with the generation prompt.
An observation's ids are the text the template puts between the end of the assistant's turn
and the next generation prompt: with ``S`` a sentinel assistant message,
``render(history + [S] + new, add_generation_prompt=True)`` minus its prefix
``render(history + [S])``, preceded by what the template closes the assistant turn with after
``S``'s content, less the end-of-turn token the policy generated itself (its ``eos_token``;
e.g. ``<|im_end|>`` is generated, the ``\\n`` after it is the environment's). So the ids of
prompt + turns + observations are those of rendering the whole conversation at once, and the
mask is right at turn boundaries; a template that rewrites earlier turns when one is added (the
rendering is not append-only) raises `ChatTemplateError`. Rendering is deterministic: the same
messages always give the same ids. (TorchTitan's RL experiment does the same with the
``renderers`` package's ``bridge_to_next_turn``.)

`TextRenderer` (the embedded default's character tokenizer, which has no chat template): the
prompt is ``<bos>`` + the first message's text, as single-turn tasks (app/envs/tasks.py); an
observation is its text's ids without special tokens, right after the turn's ``<eos>``.
"""

from __future__ import annotations

from typing import Any

Message = dict[str, Any]

_SENTINEL = "\u2063moerl-turn\u2063"  # assistant content no real turn contains


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot be extended turn by turn (see the module docstring)."""


class TextRenderer:
    """Plain text, for tokenizers without a chat template (the character tokenizer).

    Args:
        tokenizer: a Hugging Face tokenizer whose ``__call__`` adds ``<bos>`` with special tokens.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def prompt_ids(self, messages: list[Message]) -> list[int]:
        """``<bos>`` + the text of ``messages`` (the reset observation)."""
        return list(self.tokenizer("".join(m["content"] for m in messages))["input_ids"])

    def observation_ids(self, history: list[Message], new: list[Message]) -> list[int]:
        """The ids of the new messages' text, no special tokens (``history`` is not needed)."""
        return list(self.tokenizer("".join(m["content"] for m in new), add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        """A turn's text without special tokens (what the environment is sent)."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)


class ChatRenderer:
    """A tokenizer's chat template (transformers ``apply_chat_template``), turn by turn.

    Args:
        tokenizer: a Hugging Face tokenizer with ``chat_template`` and ``eos_token`` (the token
            that ends an assistant turn).

    Raises:
        ValueError: the tokenizer has no chat template.
    """

    def __init__(self, tokenizer):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("ChatRenderer: the tokenizer has no chat_template (use TextRenderer)")
        self.tokenizer = tokenizer

    def _render(self, messages: list[Message], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(self, messages: list[Message]) -> list[int]:
        """The conversation so far with the generation prompt, as ids."""
        return self._ids(self._render(messages, True))

    def observation_ids(self, history: list[Message], new: list[Message]) -> list[int]:
        """Ids to append after an assistant turn that ended with ``eos_token``, up to and
        including the next generation prompt.

        Args:
            history: the conversation before the assistant turn just generated.
            new: the environment's messages after it.

        Raises:
            ChatTemplateError: the template's rendering is not append-only here.
        """
        turn = {"role": "assistant", "content": _SENTINEL}
        before = self._render(history + [turn], False)
        after = self._render(history + [turn] + new, True)
        if not after.startswith(before) or _SENTINEL not in before:
            raise ChatTemplateError("the chat template is not append-only: adding the environment's message "
                                    "changes the text of earlier turns")
        closing = before[before.rindex(_SENTINEL) + len(_SENTINEL):]
        eos = self.tokenizer.eos_token or ""
        if eos and closing.startswith(eos):
            closing = closing[len(eos):]  # the policy generated the end-of-turn token itself
        return self._ids(closing + after[len(before):])

    def decode(self, ids: list[int]) -> str:
        """A turn's text without special tokens (what the environment is sent)."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def renderer_for(tokenizer):
    """`ChatRenderer` when the tokenizer has a chat template, else `TextRenderer`."""
    return ChatRenderer(tokenizer) if getattr(tokenizer, "chat_template", None) else TextRenderer(tokenizer)
