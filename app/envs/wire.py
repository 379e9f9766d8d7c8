"""Which fields of an environment's action and observation carry text: moerl's wire contract.

moerl speaks text to an environment: each policy turn is one string, each observation must
give one string back (the next message the policy reads). OpenEnv environments name those
fields as their authors like (OpenEnv's own template: action ``message``, observation
``echoed_message``; TextArena: ``message`` in, ``prompt`` and ``messages`` out; moerl's own:
``text`` in, ``content`` out), and publish them at ``GET /schema`` (OpenEnv
``http_server.py``: ``{"action", "observation", "reset_observation", "state"}``, each a
pydantic JSON schema). `wire_format` reads that answer once and decides:

* the action field: ``text`` or ``message`` when the action has it as a string, else the
  action's only string field; the other fields must have defaults (``metadata`` always has);
* the observation text, for the step and for the reset observation each: the first string
  field of `OBSERVATION_TEXT` it has (``content``, ``text``, ``message``, ``prompt``,
  ``observation``, ``feedback``), else its only string field, else a ``messages`` list (the
  last message's ``content``). An observation's ``role`` (if any) is its chat role, else
  ``user``.

Anything else is one `WireError` naming the schema and the field it lacks, before any
episode. Reward and done are OpenEnv's own (``reward``, ``done`` beside the observation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

ACTION_TEXT = ("text", "message")
OBSERVATION_TEXT = ("content", "text", "message", "prompt", "observation", "feedback")
_BASE_FIELDS = {"metadata", "done", "reward"}  # OpenEnv's Action/Observation base fields


class WireError(ValueError):
    """The environment's schema does not fit the contract; the message names the field."""


def _props(schema: dict) -> dict[str, dict]:
    return {k: v for k, v in (schema.get("properties") or {}).items() if k not in _BASE_FIELDS}


def _is_str(prop: dict) -> bool:
    if prop.get("type") == "string":
        return True
    return any(p.get("type") == "string" for p in prop.get("anyOf", [])) and \
        all(p.get("type") in ("string", "null") for p in prop.get("anyOf", []))


def _action_field(schema: dict) -> str:
    props = _props(schema)
    strings = [k for k, p in props.items() if _is_str(p)]
    field = next((k for k in ACTION_TEXT if k in strings), strings[0] if len(strings) == 1 else None)
    if field is None:
        have = ", ".join(f"{k}: {p.get('type', '?')}" for k, p in props.items()) or "none"
        raise WireError(f"action schema {schema.get('title', '?')!r} has no string field for the policy's turn "
                        f"(looked for {' or '.join(ACTION_TEXT)}, or a single string field; it has {have})")
    others = [k for k in schema.get("required", []) if k != field and k not in _BASE_FIELDS]
    if others:
        raise WireError(f"action schema {schema.get('title', '?')!r} requires {', '.join(others)} besides "
                        f"{field!r}; moerl sends one text field per turn")
    return field


def _observation_field(schema: dict) -> str:
    props = _props(schema)
    strings = [k for k, p in props.items() if _is_str(p)]
    field = next((k for k in OBSERVATION_TEXT if k in strings), strings[0] if len(strings) == 1 else None)
    if field is None and props.get("messages", {}).get("type") == "array":
        return "messages"
    if field is None:
        have = ", ".join(f"{k}: {p.get('type', '?')}" for k, p in props.items()) or "none"
        raise WireError(f"observation schema {schema.get('title', '?')!r} has no text field for the policy to read "
                        f"(looked for {', '.join(OBSERVATION_TEXT)}, a single string field or messages; it has {have})")
    return field


@dataclass(frozen=True)
class WireFormat:
    """Where the text goes: ``action_field`` of each step's action; ``observation_field`` of
    step observations and ``reset_field`` of the reset observation (``messages``: the last
    message's ``content``)."""

    action_field: str = "text"
    observation_field: str = "content"
    reset_field: str = "content"

    def action(self, text: str) -> dict[str, Any]:
        """The step message's data for one policy turn."""
        return {self.action_field: text}

    def message(self, observation: dict[str, Any], reset: bool = False) -> dict[str, str]:
        """``{"role", "content"}`` of one observation (its chat message).

        Raises:
            WireError: the observation lacks its text field, or it is not a string.
        """
        field = self.reset_field if reset else self.observation_field
        value = observation.get(field)
        if field == "messages" and isinstance(value, list) and value and isinstance(value[-1], dict):
            value = value[-1].get("content")
        if not isinstance(value, str):
            raise WireError(f"observation without text in {field!r}: {str(observation)[:200]}")
        role = observation.get("role")
        return {"role": role if isinstance(role, str) and role else "user", "content": value}


def wire_format(schemas: dict) -> WireFormat:
    """The `WireFormat` of an OpenEnv server's ``GET /schema`` answer.

    Raises:
        WireError: no action or observation schema, or one without a usable text field.
    """
    if not isinstance(schemas, dict) or not isinstance(schemas.get("action"), dict) \
            or not isinstance(schemas.get("observation"), dict):
        raise WireError(f"/schema answer has no action and observation schemas: {str(schemas)[:200]}")
    return WireFormat(_action_field(schemas["action"]), _observation_field(schemas["observation"]),
                      _observation_field(schemas.get("reset_observation") or schemas["observation"]))


def fetch_wire_format(url: str, timeout_s: float = 10.0) -> WireFormat:
    """`wire_format` of the server at ``url`` (``http(s)://host:port``, ``ws://`` taken too).

    Raises:
        ConnectionError: the server does not answer ``GET /schema`` with 200 (names the URL).
        WireError: see `wire_format`.
    """
    base = http_base(url)
    try:
        r = httpx.get(base + "/schema", timeout=timeout_s)
        r.raise_for_status()
        body = r.json()
    except (httpx.HTTPError, ValueError) as e:
        raise ConnectionError(f"env.url: {base}/schema did not answer as an OpenEnv server: "
                              f"{type(e).__name__}: {e}") from None
    try:
        return wire_format(body)
    except WireError as e:
        raise WireError(f"env.url {base}: {e}") from None


def http_base(url: str) -> str:
    """``ws://h:p/ws`` or ``http://h:p/`` -> ``http://h:p`` (wss -> https)."""
    base = url.rstrip("/")
    if base.endswith("/ws"):
        base = base[:-3]
    for ws, http in (("ws://", "http://"), ("wss://", "https://")):
        if base.startswith(ws):
            base = http + base[len(ws):]
    return base
