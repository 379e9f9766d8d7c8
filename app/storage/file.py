"""A directory as an object store (the embedded default's stand-in for S3)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from app.storage.store import check_range, ObjectStore, check_key, check_prefix

TMP_MARK = ".moerl-tmp-"  # temporary names start with this; list() never shows them


def _write_atomically(dst: str | os.PathLike, write) -> None:
    """Call `write(f)` on a temporary file (binary, in dst's directory), fsync, then os.replace
    it onto `dst`; on any failure the temporary file is removed and the error re-raised."""
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=TMP_MARK + dst.name + ".")
    try:
        with os.fdopen(fd, "wb") as out:
            write(out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, dst)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_copy(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Copy `src` to `dst` through a temporary file in dst's directory, fsync, then os.replace."""

    def copy(out) -> None:
        with open(src, "rb") as inp:
            shutil.copyfileobj(inp, out, 1 << 20)

    _write_atomically(dst, copy)


def atomic_write(dst: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `dst` through a temporary file, fsync, then os.replace."""
    _write_atomically(dst, lambda out: out.write(data))


class FileStore(ObjectStore):
    """Objects are files under `root`; key "a/b/c" is the file root/a/b/c.

    Args:
        root: directory (created if missing); a relative path is made absolute now.
    """

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).absolute()
        self.root.mkdir(parents=True, exist_ok=True)
        self.url = f"file://{self.root}"

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def put_file(self, local_path, key):
        if not Path(local_path).is_file():
            raise FileNotFoundError(f"put_file: {local_path} is not a file")
        atomic_copy(local_path, self._path(key))

    def get_file(self, key, local_path):
        src = self._path(key)
        if not src.is_file():
            raise FileNotFoundError(f"{self.uri(key)}: no such object")
        atomic_copy(src, local_path)
        return Path(local_path)

    def put_bytes(self, key, data):
        atomic_write(self._path(key), bytes(data))

    def get_bytes(self, key):
        path = self._path(key)
        try:
            return path.read_bytes()
        except (FileNotFoundError, IsADirectoryError):
            raise FileNotFoundError(f"{self.uri(key)}: no such object") from None

    def get_range(self, key, offset, length):
        if offset < 0 or length < 0:
            raise ValueError(f"{self.uri(key)}: bad range {offset}+{length}")
        try:
            with open(self._path(key), "rb") as f:
                f.seek(offset)
                data = f.read(length)
        except (FileNotFoundError, IsADirectoryError):
            raise FileNotFoundError(f"{self.uri(key)}: no such object") from None
        check_range(self.uri(key), offset, length, len(data))
        return data

    def exists(self, key):
        return self._path(key).is_file()

    def list(self, prefix=""):
        check_prefix(prefix)
        # Walk only the deepest directory the prefix names.
        base = self.root / prefix.rpartition("/")[0] if "/" in prefix else self.root
        if not base.is_dir():
            return []
        keys = []
        for dirpath, _, files in os.walk(base):
            for name in files:
                if name.startswith(TMP_MARK):
                    continue
                key = Path(dirpath, name).relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)

    def delete_prefix(self, prefix):
        if not prefix:
            raise ValueError("delete_prefix: prefix must be non-empty")
        keys = self.list(prefix)
        for key in keys:
            (self.root / key).unlink(missing_ok=True)
        # Remove directories left empty (deepest first), never the root.
        dirs = {(self.root / k).parent for k in keys}
        for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
            while d != self.root and d.is_dir() and not any(d.iterdir()):
                d.rmdir()
                d = d.parent
        return len(keys)
