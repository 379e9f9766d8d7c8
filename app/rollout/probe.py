"""The rollout engine's Kubernetes probe: healthy when generating, or paused on purpose.

    python3 -m app.rollout.probe --url http://127.0.0.1:30000 --marker /run/moerl/engine-paused

Exit 0 when the pause marker (written by the rollout worker, `RolloutWorker._mark_paused`:
the epoch second by which it will have continued the engine) is in the future, else when
``GET {url}/health_generate`` answers 200 within ``--timeout`` seconds; exit 1 otherwise.

Why not /health_generate alone: SGLang 0.5.23 queues that one-token request behind a pause
and answers 503 after 20 s (``entrypoints/http_server.py``), and it marks the server UnHealthy,
which makes a later SIGTERM exit at once instead of draining. The worker pauses the engine for
a whole weight load (up to ``rollout.weight_update_timeout_s``), so a plain probe would restart
the engine in the middle of a long load and flap readiness on every update. The marker has a
deadline, so a worker that died while holding it stops covering a hung engine.

Standard library only: the probe runs in the engine container every few seconds.
"""

from __future__ import annotations

import argparse
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


def paused_on_purpose(marker: str | Path | None, now: float | None = None) -> bool:
    """True when ``marker`` holds a deadline (epoch seconds) later than ``now``."""
    if not marker:
        return False
    try:
        deadline = float(Path(marker).read_text().strip())
    except (OSError, ValueError):
        return False
    return deadline > (time.time() if now is None else now)


def healthy(url: str, marker: str | Path | None, timeout_s: float) -> bool:
    """The probe's verdict (see the module doc)."""
    if paused_on_purpose(marker):
        return True
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/health_generate", timeout=timeout_s) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def main(argv: list[str] | None = None) -> int:
    """CLI entry: 0 healthy, 1 not."""
    p = argparse.ArgumentParser(prog="python -m app.rollout.probe", description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True, help="engine base URL")
    p.add_argument("--marker", default=None, help="pause marker file kept by the rollout worker")
    p.add_argument("--timeout", type=float, default=25.0, help="seconds to wait for /health_generate "
                   "(more than SGLang's own 20 s wait)")
    args = p.parse_args(argv)
    return 0 if healthy(args.url, args.marker, args.timeout) else 1


if __name__ == "__main__":
    sys.exit(main())
