"""An engine's keys (issue 39 items 6-7): the built-in engine asks for them exactly as SGLang
0.5.23 decides (its ``decide_request_auth`` and each route's ``@auth_level``, from the wheel), one
admin key per engine from a master (app/rollout/keys.py) in a file SGLang reads as its --config,
and the SGLang plugin that keeps the keys out of ``/server_info`` and the startup log, checked on
the output of SGLang's own ``build_server_info`` and against the names it hooks in the wheel."""

from __future__ import annotations

import ast
import asyncio
import json
import stat
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from app.engine import auth
from app.engine.auth import ADMIN_ROUTES, read_config_keys
from app.rollout import keys
from sglang_oracle import function_calls, route_auth_levels, sglang_dir, wheel_function, wheel_module

ROOT = Path(__file__).resolve().parents[1]


def test_the_built_in_engine_decides_keys_as_sglang():
    sgl = wheel_module("srt/utils/auth.py")
    levels = route_auth_levels()
    assert ADMIN_ROUTES == {p for p in ADMIN_ROUTES if levels[p] == "ADMIN_OPTIONAL"}  # all of them admin in SGLang
    paths = [*sorted(ADMIN_ROUTES), "/generate", "/model_info", "/server_info", "/get_server_info", "/health",
             "/health_generate", "/weight_version"]
    headers = [None, "Bearer k-api", "Bearer k-admin", "bearer k-admin", "Bearer", "Bearer ", "Basic k-admin",
               "Bearer k-admin "]
    checked = 0
    for api, admin in ((None, None), ("k-api", None), (None, "k-admin"), ("k-api", "k-admin")):
        for path in paths:
            level = getattr(sgl.AuthLevel, levels.get(path, "NORMAL"))
            for method in ("GET", "POST", "OPTIONS"):
                for h in headers:
                    want = sgl.decide_request_auth(method=method, path=path, authorization_header=h, api_key=api,
                                                   admin_api_key=admin, auth_level=level).allowed
                    assert auth.allowed(method, path, h, api, admin) == want, (method, path, h, api, admin)
                    checked += 1
    assert checked > 1000


def test_a_refused_request_gets_sglangs_answer(tmp_path):
    from app.engine.load import load_checkpoint
    from app.engine.scheduler import Engine
    from app.engine.server import create_app
    from helpers import tiny_moe_checkpoint

    engine = Engine(load_checkpoint(tiny_moe_checkpoint(tmp_path / "ck", 0, 64)), weight_version="0")
    app = create_app(engine, 0.5, admin_api_key="k-admin")

    async def go():
        await engine.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://e") as c:
                return [await c.post("/flush_cache"),
                        await c.post("/flush_cache", headers={"Authorization": "Bearer k-api"}),
                        await c.post("/flush_cache", headers={"Authorization": "Bearer k-admin"})]
        finally:
            await engine.stop()

    refused, wrong, ok = asyncio.run(go())
    assert (refused.status_code, refused.json()) == (401, {"error": "Unauthorized"})
    assert wrong.status_code == 401 and ok.status_code == 200
    assert "Unauthorized" in {c.value for c in ast.walk(ast.parse((sglang_dir() / "srt/utils/auth.py").read_text()))
                              if isinstance(c, ast.Constant)}


def test_each_engine_has_its_own_admin_key_in_a_file_only_its_owner_reads(tmp_path, monkeypatch, capsys):
    a, b = keys.engine_admin_key("master", "moerl-rollout-0"), keys.engine_admin_key("master", "moerl-rollout-1")
    assert a != b and a == keys.engine_admin_key("master", "moerl-rollout-0") != keys.engine_admin_key("other", "moerl-rollout-0")
    assert "master" not in a and len(a) == 64
    monkeypatch.setenv(keys.ADMIN_MASTER_ENV, "master")
    out = tmp_path / "keys" / "engine.yaml"
    assert keys.main(["--engine", "moerl-rollout-1", "--out", str(out)]) == 0
    assert read_config_keys(out) == (None, b)
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert "master" not in capsys.readouterr().out + out.read_text()
    monkeypatch.setenv(keys.API_KEY_SOURCE_ENV, "k-api")  # a bench fleet: callers' key too
    assert keys.main(["--engine", "moerl-bench-ep-0", "--out", str(out)]) == 0
    assert read_config_keys(out) == ("k-api", keys.engine_admin_key("master", "moerl-bench-ep-0"))
    monkeypatch.delenv(keys.ADMIN_MASTER_ENV)
    assert keys.main(["--engine", "x", "--out", str(out)]) == 2
    assert keys.ADMIN_MASTER_ENV in capsys.readouterr().err


@pytest.mark.parametrize("text, problem", [
    ("[a, b]\n", "YAML mapping"),
    ("admin-api-key: k\ntp-size: 8\n", "'tp-size'"),
    ("admin-api-key: 7\n", "admin-api-key must be a non-empty string"),
])
def test_a_bad_keys_file_is_one_error_naming_it(tmp_path, text, problem):
    path = tmp_path / "engine.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=problem) as e:
        read_config_keys(path)
    assert str(path) in str(e.value)


def test_the_engine_cli_reads_keys_from_sglangs_config_file(tmp_path):
    """``moerl engine --config`` is refused with one line naming the file's bad field."""
    from typer.testing import CliRunner

    from app.engine.server import cli
    from helpers import tiny_moe_checkpoint

    ck = tiny_moe_checkpoint(tmp_path / "ck", 0, 64)
    bad = tmp_path / "keys.yaml"
    bad.write_text("admin-api-key: k\nport: 1\n")
    r = CliRunner().invoke(cli, ["--model-path", str(ck), "--config", str(bad)])
    assert r.exit_code == 2 and "--config" in r.output and "'port'" in r.output


def test_the_plugin_keeps_the_keys_out_of_server_info_and_the_log(monkeypatch):
    """SGLang's own ``build_server_info`` (from the wheel) on an engine started with both keys,
    its launch command holding them as SGLang records it (the --config file merged into argv):
    through the plugin's hook neither key's value is anywhere in the answer; the same for the
    startup log line. The hooks are registered through SGLang's own HookRegistry on the names
    SGLang 0.5.23 calls, and the plugin is declared under SGLang's general plugin group."""
    registry = wheel_module("srt/plugins/hook_registry.py")
    monkeypatch.setitem(sys.modules, "sglang.srt.plugins.hook_registry", registry)
    monkeypatch.setattr(registry.HookRegistry, "_hooks", type(registry.HookRegistry._hooks)(list))
    keys.sglang_plugin()
    hooks = registry.HookRegistry._hooks
    assert {t: [(ht, h) for ht, h, _ in v] for t, v in hooks.items()} == {
        keys.SERVER_INFO_TARGET: [(registry.HookType.AFTER, keys.redact_server_info)],
        keys.LOG_TARGET: [(registry.HookType.AFTER, keys.redact_logged_args)]}
    # The names exist where SGLang 0.5.23 calls them.
    common = ast.parse((sglang_dir() / "srt" / "utils" / "common.py").read_text())
    assert "build_server_info" in {n.name for n in common.body if isinstance(n, ast.FunctionDef)}
    assert keys.SERVER_INFO_TARGET.rsplit(".", 1)[0] == "sglang.srt.utils.common"
    assert "build_server_info" in function_calls("srt/entrypoints/http_server.py", "server_info")
    assert keys.LOG_TARGET == "sglang.srt.entrypoints.engine._server_args_for_logging"
    assert "_server_args_for_logging" in function_calls("srt/entrypoints/engine.py", "Engine._launch_subprocesses")
    plugins = ast.parse((sglang_dir() / "srt" / "plugins" / "__init__.py").read_text())
    group = next(n.value.value for n in plugins.body if isinstance(n, ast.Assign)
                 and getattr(n.targets[0], "id", "") == "GENERAL_PLUGINS_GROUP")
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"][group]
    assert list(declared.values()) == ["app.rollout.keys:sglang_plugin"]

    build = wheel_function("srt/utils/common.py", "build_server_info",
                           {"describe_kv_events_publisher": lambda args: None, "Dict": dict, "Any": object})
    argv = ["--model-path", "m", "--admin-api-key", "k-admin-secret", "--api-key", "k-api-secret", "--tp-size", "8"]
    args = SimpleNamespace(resolved_dict=lambda: {"model_path": "m", "api_key": "k-api-secret",
                                                  "admin_api_key": "k-admin-secret", "tp_size": 8},
                           launch_command=" ".join(["python3", "-m", "sglang.launch_server", *argv]))
    plain = build(args, {"max_total_num_tokens": 1000})
    assert "k-admin-secret" in json.dumps(plain)  # what SGLang alone hands out
    info = keys.redact_server_info(plain, args, {})
    text = json.dumps(info)
    assert "k-admin-secret" not in text and "k-api-secret" not in text
    assert info["tp_size"] == 8 and info["max_total_num_tokens"] == 1000 and info["admin_api_key"] == keys.REDACTED
    logged = keys.redact_logged_args(args.resolved_dict(), args)
    assert "k-admin-secret" not in json.dumps(logged) and logged["model_path"] == "m"
