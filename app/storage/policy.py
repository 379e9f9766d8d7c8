"""Policy versions in the object store (docs/ARCHITECTURE.md, "Checkpoint layout").

    <run>/policy/v{N}/                 a Hugging Face directory (config.json, *.safetensors, index)
    <run>/policy/v{N}/moerl-manifest.json   file names and sizes, written after the files
    <run>/policy/latest                "N", written last: it names the newest complete version

A version without its manifest is incomplete (an upload that died) and is never downloaded.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from pathlib import Path

from app.storage.store import ObjectStore, run_area

MANIFEST = "moerl-manifest.json"
_VERSION_DIR = re.compile(r"^v(\d+)/")


def _root(run_id: str) -> str:
    return run_area(run_id, "policy")


def version_prefix(run_id: str, version: int) -> str:
    """Key prefix of policy `version`: '<run>/policy/v{N}/'."""
    if not isinstance(version, int) or version < 0:
        raise ValueError(f"policy version must be an int >= 0, got {version!r}")
    return f"{_root(run_id)}v{version}/"


def latest_key(run_id: str) -> str:
    return _root(run_id) + "latest"


def publish_policy(store: ObjectStore, run_id: str, version: int, local_dir: str | os.PathLike) -> str:
    """Upload the HF directory `local_dir` as policy `version`, then point `latest` at it.

    Order: every file, then the manifest, then `latest` (so a reader that sees `latest` = N
    finds v{N} complete). Re-publishing a version overwrites it.

    Returns:
        the URI of the version directory, e.g. "file:///.../<run>/policy/v3".
    Raises:
        ValueError: bad version or run_id.
        FileNotFoundError: `local_dir` is not a directory or lacks config.json or *.safetensors.
    """
    prefix = version_prefix(run_id, version)
    src = Path(local_dir)
    if not src.is_dir():
        raise FileNotFoundError(f"publish_policy: {src} is not a directory")
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"publish_policy: {src} has no config.json (not a HF checkpoint)")
    if not any(src.glob("*.safetensors")):
        raise FileNotFoundError(f"publish_policy: {src} has no *.safetensors file")
    files = sorted(p for p in src.rglob("*") if p.is_file() and p.name != MANIFEST)
    sizes = {}
    for path in files:
        rel = path.relative_to(src).as_posix()
        store.put_file(path, prefix + rel)
        sizes[rel] = path.stat().st_size
    return finish_version(store, run_id, version, sizes)


def finish_version(store: ObjectStore, run_id: str, version: int, files: dict[str, int]) -> str:
    """Make policy `version` visible once every one of its `files` (name -> size) is uploaded:
    write its manifest, then point `latest` at it. Returns the version's URI.

    Raises:
        ValueError: bad version or run_id, or `files` lacks config.json or a *.safetensors file.
    """
    if "config.json" not in files or not any(f.endswith(".safetensors") for f in files):
        raise ValueError(f"policy v{version}: files {sorted(files)[:5]}... lack config.json or *.safetensors")
    prefix = version_prefix(run_id, version)
    manifest = {"run_id": run_id, "version": version, "files": dict(sorted(files.items()))}
    store.put_bytes(prefix + MANIFEST, json.dumps(manifest, indent=1).encode())
    store.put_bytes(latest_key(run_id), str(version).encode())
    return store.uri(prefix.rstrip("/"))


def latest_policy_version(store: ObjectStore, run_id: str) -> int | None:
    """The version `latest` points at, or None if nothing was published.

    Raises:
        ValueError: `latest` holds something other than an integer (names the key).
    """
    key = latest_key(run_id)
    try:
        text = store.get_bytes(key).decode().strip()
    except FileNotFoundError:
        return None
    if not text.isdigit():
        raise ValueError(f"{store.uri(key)}: expected a version number, found {text[:40]!r}")
    return int(text)


def policy_versions(store: ObjectStore, run_id: str, *, complete_only: bool = True) -> list[int]:
    """Sorted versions present in the store (only those with a manifest if `complete_only`)."""
    root = _root(run_id)
    found: dict[int, bool] = {}
    for key in store.list(root + "v"):
        m = _VERSION_DIR.match(key[len(root):])
        if m:
            v = int(m.group(1))
            found[v] = found.get(v, False) or key.endswith("/" + MANIFEST)
    return sorted(v for v, complete in found.items() if complete or not complete_only)


def _read_manifest(store: ObjectStore, run_id: str, version: int) -> dict:
    prefix = version_prefix(run_id, version)
    try:
        return json.loads(store.get_bytes(prefix + MANIFEST))
    except FileNotFoundError:
        raise FileNotFoundError(
            f"policy v{version} of run {run_id!r} is missing or incomplete at "
            f"{store.uri(prefix.rstrip('/'))}") from None


def _matches(dest: Path, manifest: dict) -> bool:
    files = manifest["files"]
    return dest.is_dir() and all(
        (dest / rel).is_file() and (dest / rel).stat().st_size == size for rel, size in files.items())


def download_policy(store: ObjectStore, run_id: str, version: int, dest_dir: str | os.PathLike) -> Path:
    """Download policy `version` into `dest_dir` atomically; idempotent.

    Files go to a temporary sibling directory that is renamed to `dest_dir` once every file
    has arrived with the size the manifest gives. If `dest_dir` already holds this version
    (same files and sizes), it is returned untouched.

    Returns:
        Path(dest_dir).
    Raises:
        FileNotFoundError: the version is missing or incomplete in the store.
        OSError: a downloaded file's size differs from the manifest.
    """
    dest = Path(dest_dir)
    manifest = _read_manifest(store, run_id, version)
    if _matches(dest, manifest):
        return dest
    prefix = version_prefix(run_id, version)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        for rel in manifest["files"]:
            store.get_file(prefix + rel, tmp / rel)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        if not _matches(tmp, manifest):
            raise OSError(f"policy v{version} of run {run_id!r}: downloaded sizes differ from the manifest")
        if dest.exists():  # a stale or partial copy: move it aside, then swap
            old = dest.parent / f".{dest.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(dest, old)
            os.rename(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def prune_policies(store: ObjectStore, run_id: str, keep: int) -> list[int]:
    """Delete old policy versions, keeping the newest `keep` complete ones and always `latest`.

    Versions newer than `latest` are left alone (an upload may be in progress); incomplete
    versions older than `latest` are deleted. Each version's manifest is deleted first, so a
    half-deleted version reads as incomplete.

    Returns:
        the deleted versions, ascending.
    Raises:
        ValueError: keep < 1.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    latest = latest_policy_version(store, run_id)
    if latest is None:
        return []
    complete = [v for v in policy_versions(store, run_id) if v <= latest]
    kept = set(complete[-keep:]) | {latest}
    doomed = [v for v in policy_versions(store, run_id, complete_only=False) if v < latest and v not in kept]
    for v in doomed:
        prefix = version_prefix(run_id, v)
        if store.exists(prefix + MANIFEST):
            store.delete_prefix(prefix + MANIFEST)
        store.delete_prefix(prefix)
    return doomed
