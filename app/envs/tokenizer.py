"""Moved to app/model/tokenizer.py (issue 32: app/model/config.py needs it, and app/model/ must not
import app/envs/). Kept only for app/rollout/worker.py, which another change is rewriting; drop this
file once that import names app.model.tokenizer."""

from app.model.tokenizer import build_tokenizer, load_tokenizer  # noqa: F401
