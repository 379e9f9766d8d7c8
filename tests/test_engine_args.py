"""Engine profiles -> engine command lines (app/rollout/engine_args.py) and the in-flight default."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from app.config import SEQUENCES_PER_DP_RANK, EngineProfile, RolloutConfig
from app.rollout.engine_args import EngineLayout, builtin_command, sglang_command
from sglang_oracle import parse_launch_server


def flags(cmd: list[str]) -> dict[str, str | None]:
    out, i = {}, 0
    while i < len(cmd):
        if cmd[i].startswith("--"):
            value = cmd[i + 1] if i + 1 < len(cmd) and not cmd[i + 1].startswith("--") else None
            out[cmd[i]] = value
            i += 2 if value is not None else 1
        else:
            i += 1
    return out


@pytest.mark.parametrize("profile,want", [
    (EngineProfile(), {"--tp-size": "8"}),
    (EngineProfile(kind="ep"), {"--tp-size": "8", "--ep-size": "8", "--moe-a2a-backend": "none"}),
    (EngineProfile(kind="ep", tp_size=8, ep_size=4), {"--ep-size": "4", "--moe-a2a-backend": "none"}),
    (EngineProfile(kind="ep-deepep", deepep_mode="low_latency", attn_dp_size=8, enable_dp_lm_head=True,
                   moe_dense_tp_size=1, moe_runner_backend="deep_gemm", max_running_requests=512,
                   chunked_prefill_size=8192, mem_fraction_static=0.8, extra_args=["--disable-radix-cache"]),
     {"--ep-size": "8", "--moe-a2a-backend": "deepep", "--deepep-mode": "low_latency", "--attn-dp-size": "8",
      "--enable-dp-lm-head": None, "--moe-dense-tp-size": "1", "--moe-runner-backend": "deep_gemm",
      "--max-running-requests": "512", "--chunked-prefill-size": "8192", "--mem-fraction-static": "0.8",
      "--disable-radix-cache": None}),
    (EngineProfile(kind="ep-deepep", nodes_per_engine=2), {"--tp-size": "16", "--nnodes": "2",
                                                            "--node-rank": "$(LWS_WORKER_INDEX)",
                                                            "--dist-init-addr": "$(LWS_LEADER_ADDRESS):20000"}),
])
def test_each_profile_renders_sglang_flags_sglang_accepts(profile, want):
    cmd = sglang_command(EngineLayout(profile, gpus_per_node=8), "m", port=30000, routing_replay=True)
    got = flags(cmd)
    assert {k: got.get(k, "absent") for k in want} == want
    assert "--enable-return-routed-experts" in got and got["--weight-version"] == "0"
    if profile.kind == "tp":
        assert "--moe-a2a-backend" not in got and "--ep-size" not in got
    parse_launch_server(cmd, {"LWS_WORKER_INDEX": "1", "LWS_LEADER_ADDRESS": "leader"})


@pytest.mark.parametrize("profile,gpus,field", [
    (EngineProfile(nodes_per_engine=2, tp_size=8), 8, "tp_size=8"),
    (EngineProfile(tp_size=16), 8, "exceeds"),
    (EngineProfile(kind="ep", ep_size=3), 8, "ep_size=3"),
    (EngineProfile(kind="ep-deepep", ep_size=4), 8, "ep_size=4"),
    (EngineProfile(attn_dp_size=3), 8, "attn_dp_size=3"),
])
def test_layouts_that_cannot_run_name_the_field(profile, gpus, field):
    with pytest.raises(ValueError, match=field):
        EngineLayout(profile, gpus).check("rollout.engine")


@pytest.mark.parametrize("raw,field", [({"kind": "tp", "ep_size": 4}, "ep_size"),
                                       ({"enable_dp_lm_head": True}, "enable_dp_lm_head"),
                                       ({"kind": "deepep"}, "kind"), ({"nodes_per_engine": 0}, "nodes_per_engine")])
def test_bad_profiles_are_refused_by_the_config(raw, field):
    with pytest.raises(ValidationError, match=field):
        EngineProfile.model_validate(raw)


def test_inflight_sequences_default_to_the_engine_layout():
    r = RolloutConfig(group_size=8)
    assert r.inflight_tasks() == SEQUENCES_PER_DP_RANK // 8
    r.engine = EngineProfile(kind="ep-deepep", attn_dp_size=8)
    assert r.inflight_tasks() == SEQUENCES_PER_DP_RANK * 8 // 8  # 128 per data-parallel attention rank
    r.engine.max_running_requests = 40
    assert r.inflight_tasks() == 5
    r.inflight_sequences = 12
    assert r.inflight_tasks() == 1  # whole groups, at least one
    r.inflight_sequences = 3
    assert r.inflight_tasks() == 1


def test_builtin_command_uses_options_moerl_engine_has():
    from app.cli import command

    options = {o for p in command("engine").params for o in p.opts}
    cmd = builtin_command(EngineProfile(max_running_requests=32), "/m", port=1, routing_replay=True)
    assert {a for a in cmd if a.startswith("--")} <= options
    assert flags(cmd)["--max-running-requests"] == "32" and "--enable-return-routed-experts" in cmd
    with pytest.raises(ValueError, match="nodes_per_engine"):
        builtin_command(EngineProfile(nodes_per_engine=2), "/m", port=1)
