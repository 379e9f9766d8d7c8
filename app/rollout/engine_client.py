"""Client of SGLang's native HTTP API, used by rollout workers against both our built-in engine
(`app.rollout.engine_server`) and a real SGLang server.

It reads only what both servers return (SGLang ``python/sglang/srt/entrypoints/http_server.py``,
docs "SGLang Native APIs"):

- ``/generate`` answers one object for a single input with n == 1, else a list ordered
  input-major (input i, sample j at ``i * n + j``); each has ``output_ids`` (missing in some
  SGLang versions, then taken from the logprobs), ``text`` and ``meta_info`` with
  ``finish_reason`` {"type": "stop" | "length" | "abort", ...}, ``weight_version`` (a string in
  SGLang, e.g. "3" or "default") and, with ``return_logprob``, ``output_token_logprobs`` as
  ``[logprob, token_id, text_or_None]`` per generated token;
- ``/update_weights_from_disk`` {model_path, weight_version} answers {success, message, ...},
  HTTP 400 when success is false;
- ``/pause_generation``, ``/continue_generation``, ``/flush_cache``, ``/health_generate``,
  ``/get_model_info`` (``weight_version`` since SGLang 0.5).

Transient failures (connection errors, timeouts, HTTP 5xx) are retried with exponential backoff
and jitter; an HTTP 4xx is not retried. When retries run out, `EngineError` is raised.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx


class EngineError(RuntimeError):
    """The engine answered with an error, or did not answer within the retries; names the URL.

    Attributes:
        status: the HTTP status of the last answer (None when there was no answer). A 4xx means
            the request itself was refused (e.g. prompt longer than the context): retrying it
            cannot help.
    """

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status

    @property
    def rejected(self) -> bool:
        """True when the engine refused the request (HTTP 4xx), as opposed to failing."""
        return self.status is not None and 400 <= self.status < 500


@dataclass
class GenOutput:
    """One generated sequence.

    Attributes:
        token_ids: generated token ids.
        logprobs: one float per token (see the engine's definition), empty without return_logprob.
        text: decoded text ("" when the server has no tokenizer).
        finish_reason: "stop", "length", or "abort" (the server dropped the request).
        weight_version: the server's weight version as an int, None if not an integer.
    """

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    weight_version: int | None


def parse_version(value: Any) -> int | None:
    """SGLang reports weight_version as a string ("default" unless set): int, or None."""
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return None


def parse_generate_item(item: dict) -> GenOutput:
    """Read one /generate response object.

    Raises:
        EngineError: the object lacks ``meta_info``.
    """
    meta = item.get("meta_info")
    if not isinstance(meta, dict):
        raise EngineError(f"/generate answer without meta_info: {str(item)[:200]}")
    lps = meta.get("output_token_logprobs") or []
    ids = item.get("output_ids")
    if ids is None:
        ids = [int(x[1]) for x in lps]
    finish = meta.get("finish_reason") or {}
    reason = finish.get("type", "abort") if isinstance(finish, dict) else str(finish)
    return GenOutput(
        token_ids=[int(t) for t in ids],
        logprobs=[float(x[0]) for x in lps],
        text=item.get("text", ""),
        finish_reason=reason,
        weight_version=parse_version(meta.get("weight_version")),
    )


class EngineClient:
    """Async client of one engine.

    Args:
        url: base URL, e.g. "http://127.0.0.1:30000".
        timeout_s: per-request timeout in seconds.
        retries: extra attempts after the first for transient failures.
        backoff_s: first backoff in seconds; doubles per retry up to ``max_backoff_s``, with
            +-50 % jitter.
    """

    def __init__(
        self, url: str, *, timeout_s: float = 60.0, retries: int = 3, backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
    ):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"engine url must start with http:// or https://, got {url!r}")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._http = httpx.AsyncClient(base_url=self.url, timeout=timeout_s)

    async def aclose(self) -> None:
        """Close the HTTP connection pool."""
        await self._http.aclose()

    async def __aenter__(self) -> "EngineClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def _request(
        self, method: str, path: str, *, json: Any = None, retries: int | None = None,
        ok_statuses: tuple[int, ...] = (200,), timeout_s: float | None = None,
    ) -> httpx.Response:
        retries = self.retries if retries is None else retries
        last, status = "", None
        for attempt in range(retries + 1):
            try:
                r = await self._http.request(
                    method, path, json=json,
                    timeout=self.timeout_s if timeout_s is None else timeout_s,
                )
                if r.status_code in ok_statuses:
                    return r
                last, status = f"HTTP {r.status_code}: {r.text[:300]}", r.status_code
                if r.status_code < 500:
                    break  # a bad request does not get better by repeating it
            except httpx.TransportError as e:
                last, status = f"{type(e).__name__}: {e}", None
            if attempt < retries:
                delay = min(self.max_backoff_s, self.backoff_s * 2**attempt)
                await asyncio.sleep(delay * random.uniform(0.5, 1.5))
        raise EngineError(f"{method} {self.url}{path} failed: {last}", status)

    async def generate(
        self, input_ids: list[int] | list[list[int]], *, n: int = 1, max_new_tokens: int = 128,
        temperature: float = 1.0, top_p: float = 1.0, stop_token_ids: list[int] | None = None,
        return_logprob: bool = True,
    ) -> list[GenOutput]:
        """Generate ``n`` completions of each prompt in one request.

        Args:
            input_ids: one prompt (list of int) or a batch of prompts.

        Returns:
            ``len(prompts) * n`` outputs, input-major (prompt i, sample j at ``i * n + j``).

        Raises:
            EngineError: after retries, or when the answer has the wrong number of items.
        """
        batch = bool(input_ids) and isinstance(input_ids[0], list)
        n_inputs = len(input_ids) if batch else 1
        sp: dict[str, Any] = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p}
        if n != 1:
            sp["n"] = n
        if stop_token_ids:
            sp["stop_token_ids"] = list(stop_token_ids)
        body = {"input_ids": input_ids, "sampling_params": sp, "return_logprob": return_logprob}
        r = await self._request("POST", "/generate", json=body)
        data = r.json()
        items = data if isinstance(data, list) else [data]
        if len(items) != n_inputs * n:
            raise EngineError(f"{self.url}/generate returned {len(items)} items, expected {n_inputs * n}")
        return [parse_generate_item(it) for it in items]

    async def update_weights_from_disk(
        self, model_path: str, weight_version: int | None = None, *, timeout_s: float | None = None
    ) -> tuple[bool, str]:
        """Ask the engine to load ``model_path`` and report ``weight_version``.

        Returns:
            (success, message) as the engine answered (a failed load is ``success == False``:
            the engine keeps serving its previous weights).

        Raises:
            EngineError: the engine could not be reached (after retries).
        """
        body: dict[str, Any] = {"model_path": model_path}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        r = await self._request(
            "POST", "/update_weights_from_disk", json=body, ok_statuses=(200, 400), timeout_s=timeout_s
        )
        try:
            data = r.json()
        except ValueError:
            return False, f"HTTP {r.status_code}: {r.text[:300]}"
        return bool(data.get("success")), str(data.get("message", ""))

    async def pause_generation(self) -> None:
        """Stop the engine from starting new work (SGLang: POST /pause_generation)."""
        await self._request("POST", "/pause_generation", json={})

    async def continue_generation(self) -> None:
        """Let the engine take work again (POST /continue_generation)."""
        await self._request("POST", "/continue_generation", json={})

    async def flush_cache(self) -> bool:
        """Drop the prefix cache; False when the server refused (requests in flight)."""
        r = await self._request("POST", "/flush_cache", ok_statuses=(200, 400))
        return r.status_code == 200

    async def health_generate(self, timeout_s: float = 30.0) -> bool:
        """True when the engine generates a token within ``timeout_s`` (no retries)."""
        try:
            await self._request("GET", "/health_generate", retries=0, timeout_s=timeout_s)
            return True
        except EngineError:
            return False

    async def model_info(self) -> dict:
        """GET /get_model_info: model_path, weight_version, ..."""
        return (await self._request("GET", "/get_model_info")).json()

    async def weight_version(self) -> int | None:
        """The engine's current weight version as an int (None if it is not an integer)."""
        return parse_version((await self.model_info()).get("weight_version"))


def wait_until_healthy(url: str, timeout_s: float = 120.0, poll_s: float = 0.5) -> None:
    """Block until ``GET {url}/health_generate`` answers 200.

    Raises:
        TimeoutError: not healthy within ``timeout_s`` seconds; the message names the URL.
    """
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{url.rstrip('/')}/health_generate", timeout=max(1.0, poll_s * 4))
            if r.status_code == 200:
                return
            last = f"HTTP {r.status_code}"
        except httpx.TransportError as e:
            last = f"{type(e).__name__}"
        time.sleep(poll_s)
    raise TimeoutError(f"engine at {url} not healthy after {timeout_s:.0f} s (last: {last})")
