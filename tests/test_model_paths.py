"""s3:// base models on the engines (issue 26 item 4), against SGLang 0.5.23's own code:

- SGLang's model-path hook (``arg_groups/model_path_hook.py`` ``handle_load_format``, compiled
  from the wheel with its own ``is_runai_obj_uri``, ``is_remote_url`` and ``check_gguf_file``)
  resolves every rendered engine command of the DeepSeek-V3 recipe (an s3:// base model) to the
  ``auto`` load format: SGLang is given the local copy that an init container of the same pod
  fetched, never the s3:// prefix, which it would map to ``runai_streamer`` (not in the image);
- a disk update always names its load format: SGLang's tokenizer manager fills a missing one
  with the server's, and SGLang's ``get_model_loader`` (compiled from the wheel) gives the
  ``auto`` the client sends its ``DefaultModelLoader``, the only loader its disk updater takes.
"""

from __future__ import annotations

import ast
import asyncio
import logging
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from app.model.source import store_copy_dir
from app.rollout.engine_client import EngineClient
from app.engine.load import load_checkpoint
from app.engine.scheduler import Engine
from app.engine.server import create_app
from charts8s.main import build
from charts8s.rollout import BASE_MODEL_DIR
from charts8s.workloads import load_workloads
from helpers import Recorder, tiny_moe_checkpoint
from infra.config import load_config
from sglang_oracle import _function_node, function_strings, parse_launch_server, sglang_dir, wheel_function, wheel_module

ROOT = Path(__file__).resolve().parents[1]
HOOK = "srt/arg_groups/model_path_hook.py"
# what the kubelet puts in: LWS's variables and the keys of an engine on the pod network (charts8s/keys.py)
LWS_ENV = {"LWS_WORKER_INDEX": "1", "LWS_LEADER_ADDRESS": "moerl-rollout-0.moerl-rollout.moerl", "LWS_GROUP_SIZE": "2",
           "SGLANG_API_KEY": "k-api", "SGLANG_ADMIN_API_KEY": "k-admin"}
os.environ.setdefault("JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION", "1")


def sglang_load_format(ns) -> str:
    """``handle_load_format`` of the wheel on parsed launch_server arguments ``ns``: the load
    format the server resolves (and later fills into disk updates that name none)."""
    schemes = {"SUPPORTED_SCHEMES": next(ast.literal_eval(n.value) for n in ast.parse(
        (sglang_dir() / "srt/utils/runai_utils.py").read_text()).body
        if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "SUPPORTED_SCHEMES")}
    helpers = {"re": re, "Path": Path, "Union": object, "os": os}
    namespace = {
        "resolving_view": lambda sa: sa,
        "declare_resolution": lambda sa, source, **kw: [setattr(sa, k, v) for k, v in kw.items()],
        "run_post_process_pass": lambda sa, fn: None,
        "_gguf_quantization": None,
        "logger": logging.getLogger("sglang-hook"),
        "is_mistral_native_format": lambda sa: False,  # asks the Hub for a non-directory path
        "validate_transfer_engine": lambda sa: False,
        "is_runai_obj_uri": wheel_function("srt/utils/runai_utils.py", "is_runai_obj_uri", {**schemes, "Path": Path}),
        "is_remote_url": wheel_function("srt/utils/common.py", "is_remote_url", helpers),
        "check_gguf_file": wheel_function("srt/utils/hf_transformers/common.py", "check_gguf_file", helpers),
    }
    handle = wheel_function(HOOK, "handle_load_format", namespace)
    args = SimpleNamespace(**vars(ns))
    handle(args)
    return args.load_format


@pytest.fixture(scope="module")
def dsv3(tmp_path_factory):
    """The DeepSeek-V3 recipe on prod: its base model is an s3:// prefix."""
    os.chdir(ROOT)
    plan = load_workloads(load_config("prod", ROOT / "recipes" / "deepseek-v3-grpo.deploy.yaml"),
                          ROOT / "recipes" / "deepseek-v3-grpo.workloads.yaml")
    out = tmp_path_factory.mktemp("dsv3")
    build(plan, out)
    docs = [d for f in sorted(out.glob("*.k8s.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]
    return plan, docs


def engine_pods(docs) -> list[dict]:
    pods = []
    for d in docs:
        if d["kind"] == "LeaderWorkerSet":
            t = d["spec"]["leaderWorkerTemplate"]
            pods += [t["leaderTemplate"]["spec"], t["workerTemplate"]["spec"]]
        elif d["kind"] == "Deployment" and any(c["name"] == "engine" for c in d["spec"]["template"]["spec"]["containers"]):
            pods.append(d["spec"]["template"]["spec"])
    return pods


def test_the_hook_maps_an_s3_path_to_runai_streamer():
    ns = parse_launch_server(["python3", "-m", "sglang.launch_server", "--model-path", "s3://b/models/m"])
    assert ns.load_format == "auto"  # the declared default, before the hook
    assert sglang_load_format(ns) == "runai_streamer"


def test_every_engine_loads_a_local_copy_its_pod_fetched_first(dsv3):
    plan, docs = dsv3
    base = plan.wl.rollout.model_path
    assert base.startswith("s3://")
    pods = engine_pods(docs)
    assert len(pods) >= 2  # the LeaderWorkerSet's leader and worker templates
    for pod in pods:
        (engine,) = [c for c in pod["containers"] if c["name"] == "engine"]
        ns = parse_launch_server(engine["command"], LWS_ENV)
        assert sglang_load_format(ns) == "auto", ns.model_path
        assert ns.model_path == str(store_copy_dir(base, BASE_MODEL_DIR))
        (init,) = pod["initContainers"]
        assert init["command"] == ["python3", "-m", "app.model.source", base, "--cache-dir", BASE_MODEL_DIR, "--unquantized"]
        mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
        assert mounts["models"] == {m["name"]: m["mountPath"] for m in engine["volumeMounts"]}["models"]
        assert BASE_MODEL_DIR.startswith(mounts["models"] + "/")


class _Loader:
    def __init__(self, load_config):
        self.load_config = load_config


def sglang_loader_for(load_format: str) -> str:
    """The loader class SGLang's ``get_model_loader`` picks for a disk update in ``load_format``."""
    tree = ast.parse((sglang_dir() / "srt/configs/load_config.py").read_text())
    (enum_node,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LoadFormat"]
    import enum

    members = {t.targets[0].id: t.value.value for t in enum_node.body if isinstance(t, ast.Assign)}
    LoadFormat = enum.Enum("LoadFormat", members, type=str)
    names = ["DummyModelLoader", "IncModelLoader", "ModelOptModelLoader", "ShardedStateLoader", "PreshardedModelLoader",
             "BitsAndBytesModelLoader", "GGUFModelLoader", "LayeredModelLoader", "QuantizedRLModelLoader",
             "RemoteModelLoader", "RemoteInstanceModelLoader", "RunaiModelStreamerLoader", "DefaultModelLoader"]
    namespace = {n: type(n, (_Loader,), {}) for n in names}
    namespace.update(LoadFormat=LoadFormat, logger=logging.getLogger("sglang-loader"))
    get_model_loader = wheel_function("srt/model_loader/loader.py", "get_model_loader", namespace)
    config = SimpleNamespace(load_format=LoadFormat(load_format), modelopt_config=None)
    model_config = SimpleNamespace(quantization=None, modelopt_quant=None, _is_already_quantized=lambda: False)
    return type(get_model_loader(config, model_config)).__name__


def test_disk_updates_name_the_format_sglangs_updater_loads(tmp_path):
    # SGLang fills a missing load_format with the server's own ...
    node = _function_node("srt/managers/tokenizer_manager.py", "TokenizerManager.update_weights_from_disk")
    fill = next(n for n in ast.walk(node) if isinstance(n, ast.If) and "load_format is None" in ast.unparse(n.test))
    assert ast.unparse(fill.body[0]) == "obj.load_format = self.config_value('load_format')"
    # ... and its disk updater takes only the default loader: runai_streamer (an s3:// start) fails
    assert "Failed to get model loader: " in "".join(
        function_strings("srt/model_executor/model_runner_components/weight_updater.py", "WeightUpdater.update_weights_from_disk"))
    assert sglang_loader_for("runai_streamer") == "RunaiModelStreamerLoader"
    # the client always names one, and it is one the disk updater loads
    ckpt = tiny_moe_checkpoint(tmp_path / "m", seed=0, max_position_embeddings=64)
    engine = Engine(load_checkpoint(ckpt), weight_version="0", max_batch=4)
    recorder = Recorder(create_app(engine, health_timeout_s=0.5))

    async def go():
        await engine.start()
        try:
            async with EngineClient("http://engine", transport=recorder, retries=0) as c:
                await c.pause_generation("retract")
                assert (await c.update_weights_from_disk(str(ckpt), 1, flush_cache=False))[0]
                await c.continue_generation()
        finally:
            await engine.stop()

    asyncio.run(go())
    (body,) = [sent for path, sent, _, _ in recorder.calls if path == "/update_weights_from_disk"]
    assert sglang_loader_for(body["load_format"]) == "DefaultModelLoader"
