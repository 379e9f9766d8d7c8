"""Quiet logs (issue 30, item 6): no request log lines from the roles, and the Node.js runtime's
banner as text, not as Python ``b'...'`` reprs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from charts8s.node_banner import text_lines

ROOT = Path(__file__).resolve().parents[1]

ROLE_LOGGING = """
import http.server, threading
import httpx
{setup}
srv = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
threading.Thread(target=srv.serve_forever, daemon=True).start()
httpx.get(f"http://127.0.0.1:{{srv.server_port}}/nothing")
import logging; logging.getLogger("moerl.rollout").info("moerl line")
"""


def test_a_roles_logging_keeps_moerls_lines_and_drops_request_lines():
    """What `moerl rollout`, `moerl train`, `moerl feed`, `moerl engine`, `moerl env` and `moerl
    reward` set up (app/logs.py); httpx logs every request at INFO, which buried the trainer's
    step lines in a TorchX run."""
    for setup, requests in (("from app.logs import setup_logging; setup_logging()", False),
                            ("import os; os.environ['MOERL_LOG_REQUESTS'] = '1'\n"
                             "from app.logs import setup_logging; setup_logging()", True)):
        proc = subprocess.run([sys.executable, "-c", ROLE_LOGGING.format(setup=setup)], capture_output=True,
                              text=True, timeout=60, cwd=ROOT, env={"PYTHONPATH": str(ROOT)})
        assert proc.returncode == 0, proc.stderr
        assert "moerl line" in proc.stderr
        assert ("HTTP Request: GET" in proc.stderr) is requests, proc.stderr


def test_the_node_banner_is_text():
    assert text_lines(b"!!!!!!!!!!!!!!!!\n") == []
    assert text_lines(b"!!                !!\n") == []
    assert text_lines(b"!!  Node 20 is end-of-life.  !!\n") == ["node: Node 20 is end-of-life."]
    assert text_lines(b"plain warning\n") == ["plain warning"]


def test_charts8s_prints_no_byte_reprs():
    """Importing the charts starts jsii's Node process; on Node 20 its end-of-life banner came
    out as one b'...' repr per line (jsii's stderr sink prints the raw bytes)."""
    proc = subprocess.run([sys.executable, "-c", "import charts8s.main"], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin:/usr/local/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "b'" not in proc.stderr, proc.stderr[:2000]
