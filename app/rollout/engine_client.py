"""Client of SGLang's native HTTP API, used by rollout workers against both our built-in engine
(`app.engine.server`) and a real SGLang server.

It reads only what both servers return (SGLang ``python/sglang/srt/entrypoints/http_server.py``,
docs "SGLang Native APIs"):

- ``/generate`` answers one object for a single input with n == 1, else a list ordered
  input-major (input i, sample j at ``i * n + j``); each has ``output_ids`` (missing in some
  SGLang versions, then taken from the logprobs), ``text`` and ``meta_info`` with
  ``finish_reason`` {"type": "stop" | "length" | "abort", ...}, ``weight_version`` (a string in
  SGLang, e.g. "3" or "default"; an integer is read too), with ``return_logprob``
  ``output_token_logprobs`` as ``[logprob, token_id, text_or_None]`` per generated token, and
  with ``return_routed_experts`` (server started with ``--enable-return-routed-experts``)
  ``routed_experts``: base64 of the int32 ids ``[prompt + completion - 1, layers, top_k]``
  (SGLang 0.5.23 ``managers/detokenizer_manager.py``, ``state_capturer/base.py``);
- ``/update_weights_from_disk`` {model_path, weight_version (string)} answers {success,
  message, num_paused_requests}, HTTP 400 when success is false. SGLang reloads the whole
  checkpoint on every call, so this one is never retried: after a timeout ask `weight_version`;
- the weight-update group (SGLang ``io_struct``: ``InitWeightsUpdateGroupReqInput``,
  ``BeginWeightUpdateReqInput``, ``UpdateWeightsFromDistributedReqInput``,
  ``EndWeightUpdateReqInput``, ``DestroyWeightsUpdateGroupReqInput``): each answers {success,
  message}, HTTP 400 when success is false; none is ever retried (a join or a receive waits for
  the trainer's side of a collective: sending it twice would wait for a broadcast that never comes);
- ``/pause_generation`` {mode: abort | retract | in_place} (``{}`` means abort),
  ``/continue_generation``, ``/flush_cache`` (HTTP 400 when refused: a request running or
  queued), ``/health_generate`` (SGLang waits while paused and
  answers 503 after 20 s), ``/model_info`` (``/get_model_info`` is SGLang's deprecated alias).

Transient failures (connection errors, timeouts, HTTP 5xx) are retried with exponential backoff
and jitter; an HTTP 4xx is not retried. When retries run out, `EngineError` is raised.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any

import base64

import httpx
import numpy as np

# The routes SGLang 0.5.23 marks ADMIN_OPTIONAL (with --admin-api-key set they take that key, and
# only it): one list for this client and the built-in engine.
from app.engine.auth import ADMIN_ROUTES
# The engine keys' variables; app/rollout/worker.py still imports them from here.
from app.names import ADMIN_API_KEY_ENV, API_KEY_ENV  # noqa: F401

class EngineError(RuntimeError):
    """The engine answered with an error, or did not answer within the retries; names the URL.

    Attributes:
        status: the HTTP status of the last answer (None when there was no answer). A 4xx means
            the request itself was refused (e.g. prompt longer than the context): retrying it
            cannot help.
        timed_out: the last attempt was sent and got no answer within the timeout (the server
            may still be working on it); False for a refused connection or an answer.
    """

    def __init__(self, message: str, status: int | None = None, timed_out: bool = False):
        super().__init__(message)
        self.status = status
        self.timed_out = timed_out

    @property
    def rejected(self) -> bool:
        """True when the engine refused the request (HTTP 4xx), as opposed to failing."""
        return self.status is not None and 400 <= self.status < 500


PAUSE_MODES = ("abort", "retract", "in_place")


@dataclass
class GenOutput:
    """One generated sequence.

    Attributes:
        token_ids: generated token ids.
        logprobs: one float per token (see the engine's definition), empty without return_logprob.
        text: decoded text ("" when the server has no tokenizer).
        finish_reason: "stop", "length", or "abort" (the server dropped the request).
        weight_version: the server's weight version as an int, None if not an integer.
        prompt_tokens: prompt length the server counted (0 when it did not say).
        routed_experts: with return_routed_experts, the flat int32 expert ids the server sent
            (``(prompt_tokens + len(token_ids) - 1) * layers * top_k`` of them, C order); else None.
    """

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    weight_version: int | None
    prompt_tokens: int = 0
    routed_experts: np.ndarray | None = None
    # A completion resumed across weight updates (partial rollout, app/rollout/worker.py):
    # [(start, version), ...] over token_ids; None: one version (weight_version).
    version_segments: list[tuple[int, int]] | None = None


def parse_version(value: Any) -> int | None:
    """A weight version as an int: SGLang reports a string ("default" unless set, "7" when set by
    moerl); an integer is taken as it is. None for anything else (bool included)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    try:
        return int(str(value).strip())
    except (TypeError, ValueError):
        return None


def decode_routed_experts(value: Any) -> np.ndarray:
    """SGLang's ``meta_info.routed_experts``: base64 of native int32 bytes -> flat int32 array.

    Raises:
        EngineError: not a base64 string of whole int32 values.
    """
    try:
        raw = base64.b64decode(value, validate=True)
    except (TypeError, ValueError):
        raise EngineError(f"meta_info.routed_experts is not base64: {str(value)[:80]!r}") from None
    if len(raw) % 4:
        raise EngineError(f"meta_info.routed_experts: {len(raw)} bytes is not a whole number of int32 ids")
    return np.frombuffer(raw, dtype=np.int32)


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
    routed = meta.get("routed_experts")
    return GenOutput(
        token_ids=[int(t) for t in ids],
        logprobs=[float(x[0]) for x in lps],
        text=item.get("text", ""),
        finish_reason=reason,
        weight_version=parse_version(meta.get("weight_version")),
        prompt_tokens=int(meta.get("prompt_tokens") or 0),
        routed_experts=None if routed is None else decode_routed_experts(routed),
    )


class EngineClient:
    """Async client of one engine.

    Args:
        url: base URL, e.g. "http://127.0.0.1:30000".
        timeout_s: per-request timeout in seconds.
        retries: extra attempts after the first for transient failures.
        backoff_s: first backoff in seconds; doubles per retry up to ``max_backoff_s``, with
            +-50 % jitter.
        max_connections: HTTP connections kept to the engine (one per concurrent request; set it
            to the requests a worker keeps in flight, plus a few for control calls).
        transport: an httpx transport (tests: ``httpx.ASGITransport`` of the built-in engine).
        api_key, admin_api_key: SGLang's ``--api-key`` and ``--admin-api-key`` of an engine on
            the pod network, sent as bearer tokens: the admin key on `ADMIN_ROUTES`, the API key
            on every other route (with no admin key, the API key on every route, which is what
            SGLang then asks for; sglang/srt/utils/auth.py ``decide_request_auth``).
    """

    def __init__(
        self, url: str, *, timeout_s: float = 60.0, retries: int = 3, backoff_s: float = 0.5,
        max_backoff_s: float = 8.0, max_connections: int = 100, transport: httpx.AsyncBaseTransport | None = None,
        api_key: str | None = None, admin_api_key: str | None = None,
    ):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"engine url must start with http:// or https://, got {url!r}")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        # SGLang's --api-key: every route but /health* asks for it as a bearer token (sglang/srt/utils/auth.py).
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self._admin = {"Authorization": f"Bearer {admin_api_key}"} if admin_api_key else None
        self._http = httpx.AsyncClient(base_url=self.url, timeout=timeout_s, limits=limits, transport=transport,
                                       headers=headers)

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
        last, status, timed_out = "", None, False
        for attempt in range(retries + 1):
            timed_out = False
            try:
                r = await self._http.request(
                    method, path, json=json,
                    timeout=self.timeout_s if timeout_s is None else timeout_s,
                    headers=self._admin if path in ADMIN_ROUTES else None,
                )
                if r.status_code in ok_statuses:
                    return r
                last, status = f"HTTP {r.status_code}: {r.text[:300]}", r.status_code
                if r.status_code < 500:
                    break  # a bad request does not get better by repeating it
            except httpx.TransportError as e:
                # Sent but not answered in time: the server may still be working on it.
                timed_out = isinstance(e, (httpx.ReadTimeout, httpx.WriteTimeout))
                last, status = f"{type(e).__name__}: {e}", None
            if attempt < retries:
                delay = min(self.max_backoff_s, self.backoff_s * 2**attempt)
                await asyncio.sleep(delay * random.uniform(0.5, 1.5))
        raise EngineError(f"{method} {self.url}{path} failed: {last}", status, timed_out=timed_out)

    async def generate(
        self, prompt: list[int] | list[list[int]] | str, *, n: int = 1, max_new_tokens: int = 128,
        temperature: float = 1.0, top_p: float = 1.0, stop_token_ids: list[int] | None = None,
        return_logprob: bool = True, return_routed_experts: bool = False, routed_experts_start_len: int = 0,
        rid: str | None = None,
    ) -> list[GenOutput]:
        """Generate ``n`` completions of each prompt in one request.

        Args:
            prompt: one prompt's token ids, a batch of them, or one prompt as text (the server
                tokenizes it).
            return_routed_experts: ask for ``meta_info.routed_experts`` (see the module doc).
            routed_experts_start_len: the first position they cover (SGLang ``GenerateReqInput``:
                rows ``[start, prompt + completion - 1)``, start in ``[0, prompt tokens]``).
            rid: the request id (SGLang ``GenerateReqInput.rid``), what `abort_request` names:
                kept only for one input with ``n == 1`` (a batch gets ``rid_<i>``; with ``n > 1``
                SGLang 0.5.23 gives every sample a fresh id); None: the engine's own.

        Returns:
            ``len(prompts) * n`` outputs, input-major (prompt i, sample j at ``i * n + j``).

        Raises:
            EngineError: after retries, or when the answer has the wrong number of items.
        """
        if isinstance(prompt, str):
            body: dict[str, Any] = {"text": prompt}
            n_inputs = 1
        else:
            batch = bool(prompt) and isinstance(prompt[0], list)
            n_inputs = len(prompt) if batch else 1
            body = {"input_ids": prompt}
        sp: dict[str, Any] = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p}
        if n != 1:
            sp["n"] = n
        if stop_token_ids:
            sp["stop_token_ids"] = list(stop_token_ids)
        body.update(sampling_params=sp, return_logprob=return_logprob)
        if rid is not None:
            body["rid"] = rid
        if return_routed_experts:
            body["return_routed_experts"] = True
            if routed_experts_start_len:
                body["routed_experts_start_len"] = int(routed_experts_start_len)
        r = await self._request("POST", "/generate", json=body)
        data = r.json()
        items = data if isinstance(data, list) else [data]
        if len(items) != n_inputs * n:
            raise EngineError(f"{self.url}/generate returned {len(items)} items, expected {n_inputs * n}")
        return [parse_generate_item(it) for it in items]

    async def update_weights_from_disk(
        self, model_path: str, weight_version: int | None = None, *, timeout_s: float | None = None,
        flush_cache: bool | None = None, load_format: str | None = "auto",
    ) -> tuple[bool, str]:
        """Ask the engine to load ``model_path`` and report ``weight_version`` (sent as a string).

        Sent once, never retried: SGLang reloads (and flushes) on every call, and a load the
        client gave up waiting for goes on in the server. After an `EngineError` ask
        `weight_version` before sending it again.

        Args:
            flush_cache: sent when not None (SGLang's default is true: flush after the load,
                failing the call if a request is running or queued); the worker flushes
                before the update instead (`flush_cache`) and sends false.
            load_format: sent when not None; "auto" (the default) loads a Hugging Face
                safetensors directory, which every policy version is. SGLang fills a missing
                one with the format the server started with (``--load-format`` as resolved
                from ``--model-path``: an ``s3://`` path resolves to ``runai_streamer``, whose
                loader cannot update from disk: "Failed to get model loader").

        Returns:
            (success, message) as the engine answered (a failed load is ``success == False``:
            the engine keeps serving its previous weights).

        Raises:
            EngineError: no answer (``timed_out`` set when ``timeout_s`` ran out) or HTTP 5xx.
        """
        body: dict[str, Any] = {"model_path": model_path}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        if flush_cache is not None:
            body["flush_cache"] = bool(flush_cache)
        if load_format is not None:
            body["load_format"] = load_format
        r = await self._request(
            "POST", "/update_weights_from_disk", json=body, ok_statuses=(200, 400), timeout_s=timeout_s, retries=0,
        )
        try:
            data = r.json()
        except ValueError:
            return False, f"HTTP {r.status_code}: {r.text[:300]}"
        return bool(data.get("success")), str(data.get("message", ""))

    async def _control(self, path: str, body: dict, timeout_s: float | None) -> tuple[bool, str]:
        """POST a weight-update control call once; (success, message) as the engine answered.

        Raises:
            EngineError: no answer (``timed_out`` set when ``timeout_s`` ran out) or HTTP 5xx.
        """
        r = await self._request("POST", path, json=body, ok_statuses=(200, 400), timeout_s=timeout_s, retries=0)
        try:
            data = r.json()
        except ValueError:
            return False, f"HTTP {r.status_code}: {r.text[:300]}"
        return bool(data.get("success")), str(data.get("message", ""))

    async def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str,
        backend: str, *, timeout_s: float | None = None,
    ) -> tuple[bool, str]:
        """Join the engine's ranks (``rank_offset`` + tp_rank) to a weight-update group of
        ``world_size`` ranks whose rank 0 serves its rendezvous at ``master_address:master_port``.
        Returns once every rank joined (or the engine gave up)."""
        return await self._control("/init_weights_update_group", {
            "master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
            "world_size": int(world_size), "group_name": group_name, "backend": backend}, timeout_s)

    async def destroy_weights_update_group(self, group_name: str, *, timeout_s: float | None = None) -> tuple[bool, str]:
        """Leave weight-update group ``group_name``."""
        return await self._control("/destroy_weights_update_group", {"group_name": group_name}, timeout_s)

    async def begin_weight_update(self, *, timeout_s: float | None = None) -> tuple[bool, str]:
        """Open the update session SGLang 0.5.23 requires around update_weights_from_distributed."""
        return await self._control("/begin_weight_update", {"selector": "all"}, timeout_s)

    async def end_weight_update(self, *, timeout_s: float | None = None) -> tuple[bool, str]:
        """Close the update session."""
        return await self._control("/end_weight_update", {}, timeout_s)

    async def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str, *,
        load_format: str | None = None, flush_cache: bool = False, weight_version: int | None = None,
        timeout_s: float | None = None,
    ) -> tuple[bool, str]:
        """Receive one bucket from the group's rank 0 and load it (names: Hugging Face tensor
        names; dtypes: torch dtype names, e.g. "bfloat16"; load_format "flattened_bucket": one
        broadcast of their bytes back to back). ``weight_version`` (sent as a string) is taken by
        the engine only when the call succeeds; ``flush_cache`` drops the prefix cache after it."""
        body: dict[str, Any] = {"names": list(names), "dtypes": list(dtypes), "shapes": [list(s) for s in shapes],
                                "group_name": group_name, "flush_cache": bool(flush_cache)}
        if load_format is not None:
            body["load_format"] = load_format
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        return await self._control("/update_weights_from_distributed", body, timeout_s)

    async def server_info(self) -> dict:
        """GET /server_info: the server's resolved arguments (tp_size, ...) and startup_time."""
        return (await self._request("GET", "/server_info")).json()

    async def pause_generation(self, mode: str = "abort") -> None:
        """POST /pause_generation {mode} (SGLang io_struct.PauseGenerationReqInput): ``abort``
        ends in-flight requests (finish_reason abort), ``retract`` puts them back in the queue
        (their KV cache is recomputed after continue), ``in_place`` holds them as they are."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        await self._request("POST", "/pause_generation", json={"mode": mode})

    async def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """POST /abort_request {rid, abort_all} (SGLang ``AbortReq``): end the request whose id is
        ``rid`` exactly (SGLang 0.5.23 then ends every one whose id starts with it), or every one
        with ``abort_all``; a rid not in flight ends nothing. Their /generate calls answer HTTP 200
        with the tokens generated so far, their logprobs and finish_reason ``abort``. Sent once,
        never retried (an abort that comes late ends nothing it should not)."""
        if not abort_all and not rid:
            raise ValueError("abort_request: give a rid or abort_all (an empty rid would match every request)")
        await self._request("POST", "/abort_request", json={"rid": rid, "abort_all": bool(abort_all)}, retries=0)

    async def continue_generation(self) -> None:
        """Let the engine take work again (POST /continue_generation)."""
        await self._request("POST", "/continue_generation", json={})

    async def flush_cache(self) -> bool:
        """Drop the prefix cache; False when the server refused (a request running, or queued
        while not paused: SGLang ``Scheduler.flush_cache``). Never deferred (SGLang's
        ``?timeout=`` waits for the waiting line too, which a paused engine never empties)."""
        r = await self._request("POST", "/flush_cache", ok_statuses=(200, 400))
        return r.status_code == 200

    async def flush_until(self, within_s: float, every_s: float = 1.0) -> bool:
        """`flush_cache`, retried every ``every_s`` while refused, for at most ``within_s``
        seconds (what Miles and slime do after pausing, before a weight update: 60 tries a
        second apart). True once flushed; False if still refused at the end.

        Raises:
            EngineError: the engine did not answer (after the client's retries).
        """
        deadline = time.monotonic() + within_s
        while True:
            if await self.flush_cache():
                return True
            if time.monotonic() + every_s > deadline:
                return False
            await asyncio.sleep(every_s)

    async def health_generate(self, timeout_s: float = 30.0) -> bool:
        """True when the engine generates a token within ``timeout_s`` (no retries)."""
        try:
            await self._request("GET", "/health_generate", retries=0, timeout_s=timeout_s)
            return True
        except EngineError:
            return False

    async def model_info(self) -> dict:
        """GET /model_info: model_path, weight_version (a string), ..."""
        return (await self._request("GET", "/model_info")).json()

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
