"""The Node.js runtime's warnings as text, not as Python ``b'...'`` reprs.

cdk8s and aws-cdk-lib run on jsii, which starts a Node.js process and copies its stderr line by
line; a line that is not one of jsii's JSON messages (a warning banner such as "Node 20 is
end-of-life", framed in ``!!``) is printed with ``print(line)`` on the raw bytes, so every line
of it shows up as ``b'!!  ...  !!\\n'`` (jsii ``_kernel/providers/process.py``,
``stderr_sink``). `install` replaces that sink before the Node process starts: jsii's JSON
messages are copied as before, other lines are decoded, a ``!!`` banner is unframed and its
text printed once as ``node: ...`` lines, blank frame lines dropped.
"""

from __future__ import annotations

import base64
import json
import sys


def text_lines(raw: bytes) -> list[str]:
    """What to print for one non-JSON line of the Node process's stderr (no line for a frame)."""
    line = raw.decode("utf-8", "replace").rstrip("\r\n")
    body = line.strip()
    if body.startswith("!!"):
        body = body.strip("!").strip()
        return [f"node: {body}"] if body else []
    return [line] if body else []


def stderr_sink(reader) -> None:
    """jsii's stderr sink (same JSON handling), printing other lines as text (`text_lines`)."""
    for raw in iter(reader.readline, b""):
        try:
            console = json.loads(raw)
        except ValueError:
            console = None
        if isinstance(console, dict) and ("stderr" in console or "stdout" in console):
            if console.get("stderr") is not None:
                sys.stderr.buffer.write(base64.b64decode(console["stderr"]))
            if console.get("stdout") is not None:
                sys.stdout.buffer.write(base64.b64decode(console["stdout"]))
            continue
        for text in text_lines(raw if isinstance(raw, bytes) else raw.encode()):
            print(text, file=sys.stderr)


def install() -> None:
    """Use `stderr_sink` for the jsii Node process started from now on (a no-op without jsii)."""
    try:
        # jsii: optional (a no-op without it)
        from jsii._kernel.providers import process
    except ImportError:
        return
    if hasattr(process, "stderr_sink"):
        process.stderr_sink = stderr_sink
