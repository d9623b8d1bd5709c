"""`rollout.router_config_path` under the flag: the user's load balancer (verl's router YAML, built by verl's
`get_router_handle`) chooses the replica of every agent-loop turn, gets the fields it asks for, is told when each
turn ends, and follows a replica's restart; a file, class or router that cannot work is named (before Ray
for the file and the class, within the request timeout for a router that does not answer)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import ray

from async_rl.core.errors import AsyncConfigError
from async_rl.core.messages import PromptBatch
from async_rl.core.policy_clock import ClockRef
from async_rl.core.staleness import StalenessGate
from async_rl.core.timeouts import SETUP_TIMEOUT_S
from async_rl.rollout.agent_loop_files import absolute_agent_files, check_agent_loops
from async_rl.rollout.routing import ROUTER_KEY, RouterError, check_router_file, server_ids
from helpers.clusters import RAY_CALL_GUARD_S
from helpers.lineage import compose_ppo
from helpers.scripted_server import ScriptedServer
from state_machines.generate import GenerateStage

ROWS = [{"raw_prompt": [{"role": "user", "content": f"copy {d}"}], "data_source": "d", "index": i,
         "reward_model": {"ground_truth": d}} for i, d in enumerate(("123", "4567", "89"))]


def router_file(folder: Path, **fields) -> Path:
    path = folder / "router.yaml"
    path.write_text("\n".join(f"{key}: {json.dumps(value)}" for key, value in
                              {"router_class": "recording_router.RecordingRouter", **fields}.items()))
    return path


def routed_config(demo_dir, *keys: str):
    from async_rl.core.config import strip_async_keys
    from async_rl.demo import demo_overrides

    config = compose_ppo(demo_overrides(demo_dir, extra=["actor_rollout_ref.rollout.n=2", *keys]))
    strip_async_keys(config)
    return config


class Replica:  # what the stage reads of a verl RolloutReplica: the address verl's trainer names its server by
    def __init__(self, address: str):
        self._server_address = address


def test_a_router_file_that_cannot_work_is_named_before_ray(demo_dir, tmp_path):
    check_router_file(ROUTER_KEY, str(router_file(tmp_path)))
    for text, match in [("record: x\n", "no `router_class`"),
                        ("router_class: recording_router.NoSuchRouter\n", "not found in module 'recording_router'"),
                        ("router_class: no_such_package.Router\n", "Failed to import module 'no_such_package'"),
                        ("defaults: [x]\nrouter_class: recording_router.RecordingRouter\n", "Hydra 'defaults' block")]:
        path = tmp_path / "bad.yaml"
        path.write_text(text)
        with pytest.raises(AsyncConfigError, match=rf"{ROUTER_KEY}=.*bad\.yaml.*{match}"):
            check_router_file(ROUTER_KEY, str(path))
    # the start checks of a run: the file's existence, then its class
    with pytest.raises(AsyncConfigError, match=rf"{ROUTER_KEY}=.*missing\.yaml.*an existing file"):
        check_agent_loops(routed_config(demo_dir, f"{ROUTER_KEY}={tmp_path / 'missing.yaml'}"))
    (tmp_path / "bad.yaml").write_text("router_class: no_such_package.Router\n")
    with pytest.raises(AsyncConfigError, match="Failed to import module 'no_such_package'"):
        check_agent_loops(routed_config(demo_dir, f"{ROUTER_KEY}={tmp_path / 'bad.yaml'}"))
    check_agent_loops(routed_config(demo_dir, f"{ROUTER_KEY}={tmp_path / 'router.yaml'}"))


def test_the_router_file_becomes_absolute_for_the_generate_stage(demo_dir, tmp_path, monkeypatch):
    router_file(tmp_path)
    monkeypatch.chdir(tmp_path)
    config = routed_config(demo_dir, f"{ROUTER_KEY}=router.yaml")
    check_agent_loops(config)
    absolute_agent_files(config)
    assert config.actor_rollout_ref.rollout.router_config_path == str(tmp_path / "router.yaml")


def test_servers_are_named_by_their_replicas_address_where_each_has_its_own():
    assert server_ids([Replica("10.0.0.2:7001"), Replica("10.0.0.2:7002")], 2) == ["10.0.0.2:7001", "10.0.0.2:7002"]
    assert server_ids([Replica("10.0.0.2:7001"), Replica("10.0.0.2:7001")], 2) == ["replica-0", "replica-1"]
    assert server_ids(None, 3) == ["replica-0", "replica-1", "replica-2"]


def answer(kwargs, calls):
    return [7, 13, 3], 0, "completed"


def run_batch(stage):
    """One batch through the stage; the bound is a hang guard over the router actor's own start bound (a new
    actor's first answer can take minutes on 2 busy cores), never the error under test."""
    timeout_s = SETUP_TIMEOUT_S + RAY_CALL_GUARD_S
    return asyncio.run(asyncio.wait_for(stage.process_data(PromptBatch(0, ROWS)), timeout_s))


def test_the_users_router_chooses_every_turns_replica_and_hears_each_end(demo_dir, tmp_path, ray_cluster):
    record = tmp_path / "acquires.jsonl"
    config = routed_config(demo_dir, f"{ROUTER_KEY}={router_file(tmp_path, record=str(record), pick=1)}")
    servers = [ScriptedServer(answer), ScriptedServer(answer)]
    stage = GenerateStage(servers=servers, config=config, clock=ClockRef.in_process(StalenessGate(2)),
                          replicas=[Replica("10.0.0.2:7001"), Replica("10.0.0.2:7002")])
    batch = run_batch(stage)
    assert len(batch.samples) == 6
    # round-robin would have split the six trajectories 3 / 3; the router sends all to its pick, the second
    assert (len(servers[0].calls), len(servers[1].calls)) == (0, 6)
    ray.get(stage.router.handle.get_all_servers.remote(), timeout=RAY_CALL_GUARD_S)  # after the releases sent before it
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    acquired = [line for line in lines if "server" in line]
    released = [line for line in lines if "released" in line]
    assert [line["server"] for line in acquired] == ["10.0.0.2:7002"] * 6
    assert all(line["prompt_tokens"] > 0 for line in acquired)  # verl's client passes the fields it asks for
    assert sorted(line["request"] for line in released) == sorted(line["request"] for line in acquired)

    # a restart of replica 1: its old server leaves the router's pool and the new one joins under its address
    stage.replicas[1]._server_address = "10.0.0.3:7002"

    async def relaunch(replica, attempt):
        return servers[1]

    stage._replica_relaunch = relaunch
    asyncio.run(asyncio.wait_for(stage._relaunch(1, 1), RAY_CALL_GUARD_S))

    pool = ray.get(stage.router.handle.get_all_servers.remote(), timeout=RAY_CALL_GUARD_S)
    assert sorted(pool) == ["10.0.0.2:7001", "10.0.0.3:7002"]
    assert stage.router.ids == ["10.0.0.2:7001", "10.0.0.3:7002"]
    run_batch(stage)
    assert len(servers[1].calls) == 12  # the router's pick is the new server


@pytest.mark.parametrize("misbehave,error,match", [
    ("unknown_server", RouterError, r"chose server '10\.0\.0\.1:1', which is not one of its pool: replica-0"),
    ("hang", TimeoutError, rf"the load balancer of {ROUTER_KEY} did not answer acquire_server within 3 s"),
])
def test_a_router_that_misbehaves_fails_the_batch_naming_the_key(demo_dir, tmp_path, ray_cluster, misbehave, error,
                                                                 match):
    config = routed_config(demo_dir, f"{ROUTER_KEY}={router_file(tmp_path, misbehave=misbehave)}")
    stage = GenerateStage(servers=[ScriptedServer(answer)], config=config,
                          clock=ClockRef.in_process(StalenessGate(2)), request_timeout_s=3)
    with pytest.raises(error, match=match):
        run_batch(stage)
