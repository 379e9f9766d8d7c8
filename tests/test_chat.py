"""Chat templates turn by turn (app/envs/chat.py), with a small tokenizer and template built here.

The tokenizer is the character tokenizer plus ChatML's two special tokens; the template is
ChatML's shape written in the test (Jinja, as transformers' ``apply_chat_template`` reads it).
"""

from __future__ import annotations

import pytest

from app.envs.chat import ChatRenderer, ChatTemplateError, TextRenderer, renderer_for
from app.model.tokenizer import BOS_ID, EOS_ID, build_tokenizer

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Not append-only: the header counts the messages, so adding one rewrites the start.
COUNTING = "#{{ messages|length }}\n" + CHATML


def chat_tokenizer(template: str = CHATML):
    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    tok.chat_template = template
    return tok


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_turns_and_observations_rebuild_the_whole_conversation():
    tok = chat_tokenizer()
    r = renderer_for(tok)
    assert isinstance(r, ChatRenderer)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    u1 = {"role": "user", "content": "95*21="}
    a1 = {"role": "assistant", "content": "[95*21]"}
    t1 = {"role": "tool", "content": "=1995\n"}
    a2 = {"role": "assistant", "content": "1995"}
    u2 = {"role": "user", "content": "#+-=" }
    prompt = r.prompt_ids([u1])
    c1 = ids(tok, a1["content"]) + [end]  # what the engine generates: content, then <|im_end|>
    obs1 = r.observation_ids([u1], [t1])
    c2 = ids(tok, a2["content"]) + [end]
    obs2 = r.observation_ids([u1, a1, t1], [u2])
    whole = ids(tok, tok.apply_chat_template([u1, a1, t1, a2, u2], tokenize=False, add_generation_prompt=True))
    assert prompt + c1 + obs1 + c2 + obs2 == whole
    # The mask boundary: the observation is the newline after the generated <|im_end|>, the
    # tool message, and the next generation prompt; nothing the policy generated.
    assert tok.decode(obs1) == "\n<|im_start|>tool\n=1995\n<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(prompt) == "<|im_start|>user\n95*21=<|im_end|>\n<|im_start|>assistant\n"
    # Deterministic: the same messages give the same ids.
    assert r.observation_ids([u1, a1, t1], [u2]) == obs2 and r.prompt_ids([u1]) == prompt
    assert r.decode(c1) == "[95*21]"  # special tokens are not sent to the environment


def test_a_template_that_rewrites_earlier_turns_is_refused():
    r = ChatRenderer(chat_tokenizer(COUNTING))
    with pytest.raises(ChatTemplateError, match="append-only"):
        r.observation_ids([{"role": "user", "content": "x"}], [{"role": "tool", "content": "y"}])


def test_character_tokenizer_keeps_plain_text():
    tok = build_tokenizer()
    r = renderer_for(tok)
    assert isinstance(r, TextRenderer)
    prompt = r.prompt_ids([{"role": "user", "content": "ab="}])
    assert prompt[0] == BOS_ID and tok.decode(prompt, skip_special_tokens=True) == "ab="
    obs = r.observation_ids([], [{"role": "user", "content": "#+-="}])
    assert BOS_ID not in obs and tok.decode(obs) == "#+-="
    assert r.decode(ids(tok, "ba") + [EOS_ID]) == "ba"
    with pytest.raises(ValueError, match="no chat_template"):
        ChatRenderer(tok)
