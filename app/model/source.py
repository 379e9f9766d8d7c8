"""Where the base model comes from: ``model.path`` as a local directory, an ``s3://`` prefix or a
Hugging Face Hub id, resolved to a local Hugging Face checkpoint directory.

- A local directory is used as it is.
- ``s3://bucket/prefix``: the Hugging Face files directly under the prefix (`MODEL_FILES`) are
  downloaded through `app.storage` (the same S3 client, endpoint and credentials as the rest of
  moerl) into ``<cache_dir>/s3/<bucket%2Fprefix>``: into a temporary directory first, renamed
  into place once every file is there, so the directory either is complete or does not exist,
  and a second call downloads nothing (a prefix is fetched once: new weights go under a new
  prefix, as published policy versions do).
- ``owner/name``: ``huggingface_hub.snapshot_download`` with ``allow_patterns=MODEL_FILES`` into
  the Hub cache ``<cache_dir>/hub`` (the library's own cache layout, resumable downloads and
  ``HF_HUB_OFFLINE`` / ``HF_TOKEN`` handling).

One process per host downloads: every process takes a file lock (`lock_path`) in the cache dir
first, so the others wait for it and then find the finished directory.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import sys
import uuid
from fnmatch import fnmatch
from pathlib import Path
from urllib.parse import quote

from filelock import FileLock, Timeout

from app.storage import open_store

log = logging.getLogger(__name__)

# The files of a Hugging Face model directory the trainer and the engines read: configs,
# weights and index, tokenizer. Only top-level files: repositories also keep other formats in
# subfolders (e.g. original/ with consolidated .pth files).
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
# A read-only file-system copy of one store prefix (FSx for Lustre linked to the checkpoint bucket,
# mounted by the pods that charts8s/fsx.py gives it): "s3://bucket/prefix/=/mount/prefix/" makes an
# s3:// model.path under that prefix resolve to the mounted directory instead of a download.
MIRROR_ENV = "MOERL_S3_MIRROR"
# owner/name as the Hub spells repository ids (huggingface_hub validate_repo_id checks the rest).
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def resolve_model_path(path: str, cache_dir: str | os.PathLike) -> Path:
    """The local Hugging Face directory of ``model.path``, downloaded first if it is remote.

    Args:
        path: ``model.path``: an existing local directory, ``s3://bucket/prefix`` or a Hub id
            ``owner/name`` (a local directory of that name wins, as in transformers).
        cache_dir: where remote models are kept (one per host, shared by its processes).

    Returns:
        A directory holding config.json and the weights (for the Hub: the snapshot directory
        inside the Hub cache).

    Raises:
        FileNotFoundError: the directory, prefix or repository does not exist or holds no
            config.json / weights, or the Hub cannot be reached and nothing is cached (message
            names ``model.path``).
        PermissionError, ConnectionError, OSError: the store refused or could not be reached
            (``model.path`` named).
    """
    if path.startswith("s3://"):
        return mirrored(path) or _from_store(path, Path(cache_dir))
    local = Path(path).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise FileNotFoundError(
                f"model.path {path!r}: {local} has no config.json (expected an HF checkpoint directory)"
            )
        return local
    if _HUB_ID.fullmatch(path) and not path.startswith((".", "~")):
        return _from_hub(path, Path(cache_dir))
    raise FileNotFoundError(
        f"model.path {path!r}: not a local directory, an s3://bucket/prefix or a Hugging Face Hub id (owner/name)"
    )


def mirrored(url: str) -> Path | None:
    """The directory of ``s3://...`` `url` on the file-system copy named by MIRROR_ENV, when it is
    there (its config.json exists); None without a mirror, outside its prefix, or before the copy
    has the files (the caller then reads the store, which stays the source of truth).

    Raises ValueError naming MIRROR_ENV when the variable is not ``s3://bucket/prefix/=/path``.
    """
    spec = os.environ.get(MIRROR_ENV)
    if not spec:
        return None
    src, sep, dst = spec.partition("=")
    if not (sep and src.startswith("s3://") and src.endswith("/") and dst.startswith("/")):
        raise ValueError(f"{MIRROR_ENV}={spec!r}: expected s3://bucket/prefix/=/absolute/path")
    if not url.rstrip("/").startswith(src.rstrip("/") + "/"):
        return None
    local = Path(dst) / url.rstrip("/")[len(src):]
    return local if (local / "config.json").is_file() else None


def lock_path(path: str, cache_dir: str | os.PathLike) -> Path:
    """The file whose lock serializes the download of remote ``model.path`` on this host."""
    return Path(cache_dir) / ".locks" / (quote(path, safe="") + ".lock")


class _HostLock:
    """`lock_path`'s lock, held for a download; logs when another process holds it."""

    def __init__(self, path: str, cache_dir: Path):
        file = lock_path(path, cache_dir)
        file.parent.mkdir(parents=True, exist_ok=True)
        self.lock, self.path = FileLock(str(file)), path

    def __enter__(self):
        try:
            self.lock.acquire(timeout=0)
        except Timeout:
            log.info("model.path %s: waiting for another process on this host to fetch it", self.path)
            self.lock.acquire()
        return self

    def __exit__(self, *exc):
        self.lock.release()


def _wanted(name: str) -> bool:
    return "/" not in name and any(fnmatch(name, p) for p in MODEL_FILES)


def _check_files(path: str, names: set[str], where: str) -> None:
    if "config.json" not in names:
        raise FileNotFoundError(f"model.path {path!r}: no config.json in {where}")
    if "model.safetensors.index.json" not in names and "model.safetensors" not in names:
        raise FileNotFoundError(
            f"model.path {path!r}: no model.safetensors or model.safetensors.index.json in {where}"
        )


def store_copy_dir(url: str, cache_dir: str | os.PathLike) -> Path:
    """Where `resolve_model_path` keeps the copy of ``s3://bucket/prefix`` under ``cache_dir``
    (known before the download: charts8s points SGLang's ``--model-path`` at it)."""
    if not url.startswith("s3://"):
        raise ValueError(f"model.path {url!r}: not an s3:// prefix")
    return Path(cache_dir) / "s3" / quote(url.rstrip("/")[len("s3://"):], safe="")


def config_source(path: str, cache_dir: str | os.PathLike) -> str:
    """What ``transformers.AutoConfig.from_pretrained`` can read ``model.path``'s config.json
    from without fetching the weights: for ``s3://bucket/prefix``, a directory under
    ``cache_dir`` holding only that file (downloaded once); else the path itself (a local
    directory, or a Hub id whose config the Hub client fetches alone)."""
    if not path.startswith("s3://"):
        return path
    local = mirrored(path)
    if local:
        return str(local)

    dest = Path(cache_dir) / "s3-config" / quote(path.rstrip("/")[len("s3://"):], safe="")
    if not (dest / "config.json").is_file():
        dest.mkdir(parents=True, exist_ok=True)
        data = open_store(path.rstrip("/")).get_bytes("config.json")
        tmp = dest / f".config.json.{uuid.uuid4().hex[:8]}"
        tmp.write_bytes(data)
        os.replace(tmp, dest / "config.json")
    return str(dest)


def _from_store(url: str, cache_dir: Path) -> Path:
    # botocore: only for an s3:// model
    from botocore.exceptions import BotoCoreError, ClientError

    url = url.rstrip("/")
    dest = store_copy_dir(url, cache_dir)
    with _HostLock(url, cache_dir):
        if dest.is_dir():  # only a finished download is ever renamed to dest
            return dest
        try:
            store = open_store(url)
            keys = [k for k in store.list() if _wanted(k)]
            _check_files(url, set(keys), "that prefix")
            for stale in dest.parent.glob(f".{dest.name}.tmp-*"):  # left by a process killed mid-download
                shutil.rmtree(stale, ignore_errors=True)
            log.info("model.path %s: downloading %d files into %s", url, len(keys), dest)
            tmp = dest.parent / f".{dest.name}.tmp-{uuid.uuid4().hex[:8]}"
            try:
                for key in keys:
                    store.get_file(key, tmp / key)
                os.rename(tmp, dest)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        except (FileNotFoundError, PermissionError, ConnectionError, ValueError) as e:
            if str(e).startswith("model.path"):
                raise
            raise type(e)(f"model.path {url!r}: {e}") from None
        except (BotoCoreError, ClientError) as e:  # e.g. ListObjectsV2 denied
            raise OSError(f"model.path {url!r}: {type(e).__name__}: {e}") from None
    return dest


def _from_hub(repo_id: str, cache_dir: Path) -> Path:
    # huggingface_hub: only for a Hub id
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, HfHubHTTPError, LocalEntryNotFoundError

    with _HostLock(repo_id, cache_dir):
        try:
            snapshot = Path(snapshot_download(
                repo_id, cache_dir=cache_dir / "hub", allow_patterns=list(MODEL_FILES), ignore_patterns=["*/*"]))
        except (LocalEntryNotFoundError, HfHubHTTPError, HFValidationError) as e:
            detail = " ".join(str(e).split())
            raise FileNotFoundError(
                f"model.path {repo_id!r}: no local directory of that name, and Hugging Face Hub repo {repo_id} "
                f"could not be fetched: {type(e).__name__}: {detail}"
            ) from None
    _check_files(repo_id, {p.name for p in snapshot.iterdir()}, f"Hub snapshot {snapshot}")
    return snapshot


def check_unquantized(path: str, local: Path) -> None:
    """Raise ValueError naming ``model.path`` when ``local``/config.json declares a
    quantization_config: a bf16 copy made by DeepSeek's fp8_cast_bf16.py keeps it, and SGLang
    would then build FP8 layers whose scales no policy version carries."""
    quant = json.loads((local / "config.json").read_text()).get("quantization_config")
    if quant:
        raise ValueError(f"model.path {path!r}: config.json has quantization_config (quant_method "
                         f"{quant.get('quant_method')!r}); the engines serve unquantized policy versions: remove it "
                         "from the copy's config.json, or serve an unquantized checkpoint")


def main(argv: list[str] | None = None) -> int:
    """``python3 -m app.model.source PATH --cache-dir DIR``: fetch ``model.path`` PATH (see
    `resolve_model_path`) into DIR and print the local directory; one line on stderr and exit
    2 when it cannot be had. The rollout pods' init container runs it on every node of an
    engine, so that SGLang loads a local directory (charts8s/rollout.py)."""
    p = argparse.ArgumentParser(prog="python3 -m app.model.source", description=main.__doc__.splitlines()[0])
    p.add_argument("path")
    p.add_argument("--cache-dir", required=True)
    p.add_argument("--unquantized", action="store_true",
                   help="refuse a checkpoint whose config.json has a quantization_config (the engines serve "
                        "policy versions, which carry unquantized tensors without scales)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        local = resolve_model_path(args.path, args.cache_dir)
        if args.unquantized:
            check_unquantized(args.path, local)
        print(local, flush=True)
    except (OSError, ValueError) as e:
        print(f"app.model.source: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
