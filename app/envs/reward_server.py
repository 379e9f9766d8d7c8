"""`moerl reward`: score completions over HTTP, with a learned reward model or the task's verifier.

    moerl reward --config run.yaml --host 0.0.0.0 --port 8080 [--max-batch 64] [--max-wait-ms 5] [--mode auto]

Mode (``--mode auto``): with ``task.reward_model`` set, the server loads that Hugging Face sequence-classification
checkpoint (``AutoModelForSequenceClassification`` with one label, and its tokenizer) and a
sequence's reward is the model's scalar output. Without it, it serves the task's verifier
(`app.envs.rewards.score_answer_spec`), which needs each sequence's ``Task.answer`` JSON.
``--mode model`` / ``--mode verifier`` force one (the env pool's CPU pods serve the verifier even
when a GPU reward-model server exists; ``model`` without ``task.reward_model`` is an error).

API (JSON):
  ``POST /score``  ``{"input_ids": [[int, ...], ...]}`` or ``{"text": ["...", ...]}`` (exactly one;
      the verifier also needs ``"answer": ["<Task.answer JSON>", ...]``, one per text)
      -> ``{"rewards": [float, ...], "model": "<path or 'verifier'>"}``, one reward per sequence,
      in request order. Text is tokenized with the model's tokenizer (``<bos>`` prepended as for
      generation); ``input_ids`` are used as given.
  ``GET /health`` -> ``{"status": "ok", "mode": "model" | "verifier", "model": ...}``
  ``GET /stats``  -> batching counters: requests, sequences, batches, largest_batch.
A malformed request gets one 4xx answer naming the field (``{"error": "..."}``): 422 for a body
that is not the schema (missing / both / extra fields, wrong types, empty lists), 400 for values
the model cannot take (a token id outside the vocabulary, a sequence longer than
``--max-length``, a list of answers whose length differs from the texts, token ids sent to the
verifier).

Batching: requests wait in one queue; a batch is formed from the first waiting request plus every
request that arrives within ``--max-wait-ms`` (up to ``--max-batch`` sequences) and runs as ONE
right-padded forward in a worker thread, so the event loop keeps accepting requests meanwhile.
Rollout workers score the G completions of a group concurrently, so their requests meet here.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import typer
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from app.config import RunConfig
from app.envs.rewards import SCORERS, score_answer_spec
from app.logs import setup_logging

log = logging.getLogger("moerl.reward")


class BadRequest(ValueError):
    """A request the server cannot score; the message names the field (answered with 400)."""


class ScoreRequest(BaseModel):
    """Body of ``POST /score``: exactly one of ``input_ids`` / ``text``."""

    model_config = ConfigDict(extra="forbid")
    input_ids: list[list[int]] | None = Field(None, min_length=1)
    text: list[str] | None = Field(None, min_length=1)
    answer: list[str] | None = None


# --------------------------------------------------------------------------------------------
# Scorers: a batch of sequences -> one float each


class ModelScorer:
    """An HF sequence-classification model with one output, on CPU or one GPU.

    Args:
        path: checkpoint directory with config.json and tokenizer files, or a Hub id.
        max_length: longest sequence accepted, in tokens.
        device: torch device; default CUDA when available.

    Raises:
        FileNotFoundError: ``path`` is a directory without config.json (or a path that does not exist).
        ValueError: the model does not have exactly one label, or no ``pad_token_id``
            (sequence classification pools the last non-pad token of each row).
    """

    mode = "model"

    def __init__(self, path: str | os.PathLike, max_length: int = 512, device: str | None = None):
        # torch and transformers: the model mode only; the verifier mode (the env pool's CPU
        # pods) serves without them
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        local = Path(path)
        hub_id = not local.exists() and not str(path).startswith(("/", ".")) and str(path).count("/") == 1
        if not hub_id and not (local / "config.json").is_file():
            raise FileNotFoundError(f"task.reward_model: {path} has no config.json (expected an HF checkpoint "
                                    "directory or a Hub id 'org/name')")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        # no Hub kernels: app/engine/load.py says why
        self.model = AutoModelForSequenceClassification.from_pretrained(str(path), use_kernels=False).to(self.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        cfg = self.model.config
        if cfg.num_labels != 1:
            raise ValueError(f"task.reward_model: {path} has num_labels={cfg.num_labels}; a reward model has 1")
        self.pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else self.tokenizer.pad_token_id
        if self.pad_id is None:
            raise ValueError(f"task.reward_model: {path} has no pad_token_id (needed to batch sequences)")
        self.model.config.pad_token_id = self.pad_id
        self.vocab_size = cfg.vocab_size
        self.max_length = max_length
        self.name = str(path)

    def check(self, req: ScoreRequest) -> list[list[int]]:
        """Token ids of every sequence of ``req``, validated.

        Raises:
            BadRequest: an id outside ``[0, vocab_size)``, a pad id inside a sequence, an empty
                or too long sequence.
        """
        if req.answer is not None:
            raise BadRequest("answer: only the verifier takes answers; this server scores with a model")
        seqs = req.input_ids if req.input_ids is not None else [self.tokenizer(t)["input_ids"] for t in req.text]
        field = "input_ids" if req.input_ids is not None else "text"
        for i, s in enumerate(seqs):
            if not s:
                raise BadRequest(f"{field}[{i}]: empty sequence")
            if len(s) > self.max_length:
                raise BadRequest(f"{field}[{i}]: {len(s)} tokens > max length {self.max_length}")
            bad = [x for x in s if not 0 <= x < self.vocab_size]
            if bad:
                raise BadRequest(f"{field}[{i}]: token id {bad[0]} outside the vocabulary [0, {self.vocab_size})")
            if self.pad_id in s:
                raise BadRequest(f"{field}[{i}]: contains the pad id {self.pad_id}")
        return seqs

    def __call__(self, seqs: list[list[int]]) -> list[float]:
        """Rewards of ``seqs`` in one right-padded forward: ``[B]`` float32 -> Python floats."""
        import torch  # the model mode only (see __init__)

        width = max(map(len, seqs))
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            attn[i, : len(s)] = 1
        with torch.no_grad():
            logits = self.model(input_ids=ids.to(self.device), attention_mask=attn.to(self.device)).logits
        return logits[:, 0].float().cpu().tolist()


class VerifierScorer:
    """The task's verifier (`app.envs.rewards.score_answer_spec`) behind the same interface."""

    mode = "verifier"
    name = "verifier"

    def check(self, req: ScoreRequest) -> list[tuple[str, str]]:
        """``(answer JSON, text)`` pairs of ``req``.

        Raises:
            BadRequest: token ids given, ``answer`` missing / of a different length, or an
                answer that is not a JSON answer spec with a known ``source``.
        """
        if req.input_ids is not None:
            raise BadRequest("input_ids: the verifier scores text; send text and answer")
        if req.answer is None or len(req.answer) != len(req.text):
            n = "none" if req.answer is None else len(req.answer)
            raise BadRequest(f"answer: the verifier needs one answer per text ({len(req.text)}), got {n}")
        for i, answer in enumerate(req.answer):
            # The answer spec written by app/envs/tasks.py or jsonl.py; anything else would
            # silently score 0.
            try:
                spec = json.loads(answer)
            except (TypeError, json.JSONDecodeError):
                raise BadRequest(f"answer[{i}]: not a JSON answer spec") from None
            if not isinstance(spec, dict) or spec.get("source") not in SCORERS:
                raise BadRequest(f"answer[{i}]: 'source' must be one of {sorted(SCORERS)}")
        return list(zip(req.answer, req.text))

    def __call__(self, items: list[tuple[str, str]]) -> list[float]:
        return [score_answer_spec(answer, text) for answer, text in items]


# --------------------------------------------------------------------------------------------
# Batching


@dataclass
class BatchStats:
    requests: int = 0
    sequences: int = 0
    batches: int = 0
    largest_batch: int = 0


class Batcher:
    """Collect concurrent requests into batches for ``fn(items) -> rewards`` (see module doc).

    Args:
        fn: scores a list of items, one float each; runs in a worker thread.
        max_batch: most sequences in one call of ``fn`` (a larger request is split).
        max_wait_s: how long the first request of a batch waits for others.
    """

    def __init__(self, fn: Callable[[list], list[float]], max_batch: int = 64, max_wait_s: float = 0.005):
        if max_batch < 1 or max_wait_s < 0:
            raise ValueError(f"max_batch must be >= 1 and max_wait_s >= 0, got {max_batch}, {max_wait_s}")
        self.fn, self.max_batch, self.max_wait_s = fn, max_batch, max_wait_s
        self.stats = BatchStats()
        self._queue: asyncio.Queue | None = None
        self._task: asyncio.Task | None = None
        self._lock = threading.Lock()  # one forward at a time (the model is not re-entrant)

    async def submit(self, items: list) -> list[float]:
        """Score ``items`` (one request) together with whatever else is waiting."""
        if self._task is None or self._task.done():  # started lazily, inside the serving loop
            self._queue = asyncio.Queue()
            self._task = asyncio.create_task(self._run())
        future = asyncio.get_running_loop().create_future()
        self.stats.requests += 1
        await self._queue.put((items, future))
        return await future

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            waiting = [await self._queue.get()]
            n = len(waiting[0][0])
            deadline = loop.time() + self.max_wait_s
            while n < self.max_batch:
                timeout = deadline - loop.time()
                if timeout <= 0:
                    break
                try:
                    nxt = await asyncio.wait_for(self._queue.get(), timeout)
                except asyncio.TimeoutError:
                    break
                waiting.append(nxt)
                n += len(nxt[0])
            items = [x for req, _ in waiting for x in req]
            try:
                rewards = await asyncio.to_thread(self._score, items)
            except Exception as e:  # noqa: BLE001 - every waiting request gets the error
                for _, fut in waiting:
                    if not fut.done():
                        fut.set_exception(e)
                continue
            offset = 0
            for req, fut in waiting:
                if not fut.done():
                    fut.set_result(rewards[offset : offset + len(req)])
                offset += len(req)

    def _score(self, items: list) -> list[float]:
        out: list[float] = []
        with self._lock:
            for i in range(0, len(items), self.max_batch):
                chunk = items[i : i + self.max_batch]
                out += self.fn(chunk)
                self.stats.batches += 1
                self.stats.sequences += len(chunk)
                self.stats.largest_batch = max(self.stats.largest_batch, len(chunk))
        return out


# --------------------------------------------------------------------------------------------
# The app


def make_app(scorer, max_batch: int = 64, max_wait_ms: float = 5.0):
    """The FastAPI app serving ``scorer`` (`ModelScorer` or `VerifierScorer`) with batching."""
    app = FastAPI(title="moerl reward")
    batcher = Batcher(scorer, max_batch=max_batch, max_wait_s=max_wait_ms / 1000)
    app.state.batcher = batcher

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {"loc": (), "msg": "invalid request"}
        where = ".".join(str(x) for x in first["loc"] if x != "body") or "body"
        return JSONResponse(status_code=422, content={"error": f"{where}: {first['msg']}"})

    @app.post("/score")
    async def score(req: ScoreRequest):
        if (req.input_ids is None) == (req.text is None):
            return JSONResponse(status_code=422, content={"error": "body: give exactly one of input_ids or text"})
        try:
            items = scorer.check(req)
        except BadRequest as e:
            return JSONResponse(status_code=400, content={"error": str(e)})
        rewards = await batcher.submit(items)
        return {"rewards": rewards, "model": scorer.name}

    @app.get("/health")
    async def health():
        return {"status": "ok", "mode": scorer.mode, "model": scorer.name}

    @app.get("/stats")
    async def stats():
        return asdict(batcher.stats)

    return app


def make_scorer(cfg, max_length: int = 512, mode: str = "auto"):
    """The scorer of ``mode``: ``auto`` = `ModelScorer` of ``task.reward_model`` if set, else
    `VerifierScorer`; ``model`` / ``verifier`` force one.

    Raises:
        ValueError: unknown mode, or ``model`` without ``task.reward_model``.
    """
    if mode not in ("auto", "model", "verifier"):
        raise ValueError(f"--mode must be auto, model or verifier, got {mode!r}")
    if mode == "model" and not cfg.task.reward_model:
        raise ValueError("--mode model: the run config names no task.reward_model")
    if mode != "verifier" and cfg.task.reward_model:
        return ModelScorer(cfg.task.reward_model, max_length=max_length)
    return VerifierScorer()


cli = typer.Typer(add_completion=False, help="Serve a reward model (or the task's verifier) over HTTP.")


@cli.command()
def serve(
    config: Path = typer.Option(None, "--config", help="Run config YAML (task.reward_model)."),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8080, "--port", min=1, max=65535),
    max_batch: int = typer.Option(64, "--max-batch", min=1, help="Most sequences in one forward."),
    max_wait_ms: float = typer.Option(5.0, "--max-wait-ms", min=0.0, help="How long a batch waits to fill."),
    max_length: int = typer.Option(512, "--max-length", min=1, help="Longest sequence, tokens."),
    threads: int = typer.Option(0, "--threads", min=0, help="torch CPU threads (0: leave torch's default)."),
    mode: str = typer.Option("auto", "--mode", help="auto | model | verifier (see the module docstring)."),
) -> None:
    """Serve POST /score, GET /health, GET /stats (see the module docstring)."""
    setup_logging()
    try:
        cfg = RunConfig.load(config) if config else RunConfig()
        if threads:
            import torch  # the model mode's (see ModelScorer)

            torch.set_num_threads(threads)
        scorer = make_scorer(cfg, max_length=max_length, mode=mode)
    except (FileNotFoundError, ValueError) as e:
        typer.echo(f"moerl reward: {e}", err=True)
        raise SystemExit(2) from None
    log.info("serving %s (%s) on %s:%d", scorer.name, scorer.mode, host, port)
    t0 = time.monotonic()
    uvicorn.run(make_app(scorer, max_batch, max_wait_ms), host=host, port=port, log_level="warning")
    log.info("stopped after %.0f s", time.monotonic() - t0)
