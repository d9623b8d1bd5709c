"""Placement of `trainer.use_nodes_ratios` on the job's nodes (async_rl/core/placement.py) and the node
choice (async_rl/core/devices.py pick_nodes): pure functions, no Ray."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from async_rl.core.config import read_async_config
from async_rl.core.devices import GroupDevices, device_bundle, pick_nodes
from async_rl.core.placement import DeviceRange, PlacementError, plan_placement

ALL_ROLES = ["train", "logp", "ref_logp"]


def ratios(values):
    return read_async_config(OmegaConf.create({"trainer": {"use_nodes_ratios": values}})).ratios_by_role


def test_proposal_default_puts_training_roles_together_and_generate_on_the_other_half():
    plan = plan_placement(2, 4, ratios([0.5, 0.5, 0.5, 0.5]), ALL_ROLES, replica_devices=1)
    assert plan.shared and plan.colocate_count == 3
    assert {role: r for role, r in plan.groups.items()} == {role: DeviceRange(0, 4) for role in ALL_ROLES}
    assert [r.start for r in plan.replicas] == [4, 5, 6, 7]  # node 1, whole
    assert plan.describe() == "node 0: train x4, logp x4, ref_logp x4; node 1: generate x4 replica(s)"
    assert plan.metrics() == {"async/devices/train": 4.0, "async/devices/logp": 4.0, "async/devices/ref_logp": 4.0,
                              "async/devices/generate": 4.0, "async/devices/shared": 1.0}


def test_ratios_that_fit_side_by_side_get_devices_of_their_own_packed_by_node():
    plan = plan_placement(4, 2, ratios([0.5, 0.125, 0.125, 0.25]), ALL_ROLES, replica_devices=2)
    assert not plan.shared and plan.colocate_count == 1
    assert plan.groups == {"train": DeviceRange(0, 4), "logp": DeviceRange(4, 1), "ref_logp": DeviceRange(5, 1)}
    assert plan.replicas == (DeviceRange(6, 2),)  # tp=2: one replica on the last node
    # the critic (5th number, default the train ratio's) is packed after train when it fits
    plan = plan_placement(4, 2, ratios([0.25, 0.125, 0.125, 0.25, 0.25]), ["train", "critic", "logp"], 1)
    assert plan.groups == {"train": DeviceRange(0, 2), "critic": DeviceRange(2, 2), "logp": DeviceRange(4, 1)}


def test_a_small_group_never_straddles_two_nodes():
    # train 3 of node 0's 4 devices, logp 2: it would straddle nodes 0 and 1, so it starts node 1
    plan = plan_placement(2, 4, ratios([0.375, 0.25, 0.125, 0.125]), ALL_ROLES, 1)
    assert plan.groups["logp"] == DeviceRange(4, 2) and plan.groups["ref_logp"] == DeviceRange(6, 1)
    for role, devices in plan.groups.items():
        assert len(devices.nodes(4)) == 1, role
    assert plan.replicas == (DeviceRange(7, 1),)
    # one more ref device and alignment leaves no room side by side: the training roles share instead
    plan = plan_placement(2, 4, ratios([0.375, 0.25, 0.25, 0.125]), ALL_ROLES, 1)
    assert plan.shared and plan.groups["logp"] == DeviceRange(0, 2)


@pytest.mark.parametrize("values, nodes, per_node, match", [
    # train gets 3 devices over two 2-device nodes: FSDP needs the same ranks per node
    ([0.75, 0.25, 0.25, 0.25], 2, 2, r"gives train 3 devices .* on nodes \[0, 1\].*whole nodes"),
    ([0.5, 0.5, 0.5, 1.0], 1, 2, "leaving none to train on"),
    ([1.0, 0.5, 0.5, 0.5], 2, 2, "gives train 4 devices .* leaves 2"),
])
def test_placements_that_cannot_work_name_the_key_and_the_nodes(values, nodes, per_node, match):
    with pytest.raises(PlacementError, match=match) as info:
        plan_placement(nodes, per_node, ratios(values), ALL_ROLES, 1)
    assert "trainer.use_nodes_ratios" in str(info.value)


@pytest.mark.parametrize("per_node, replica_devices", [(1, 1), (2, 2)])
def test_a_replica_on_every_device_leaves_no_room_to_train_and_says_so(per_node, replica_devices):
    # verl's 1-GPU examples, and its 2-GPU LoRA example at tensor_model_parallel_size=2: whatever the ratios
    for generate in (0.5, 0.25):
        with pytest.raises(PlacementError, match=f"one rollout replica spans {replica_devices} devices .*"
                                                 f"all {per_node} of 1 node.*more devices or a smaller replica"):
            plan_placement(1, per_node, ratios([0.5, 0.5, 0.5, generate]), ALL_ROLES, replica_devices)


def test_a_replica_must_fit_inside_a_node():
    with pytest.raises(PlacementError, match="tensor_model_parallel_size"):
        plan_placement(2, 2, ratios([0.5, 0.5, 0.5, 0.5]), ALL_ROLES, replica_devices=4)


def test_group_devices_map_ranks_to_node_bundles():
    devices = GroupDevices(("pg0", "pg1", "pg2"), DeviceRange(2, 4), per_node=2, colocate_count=3)
    assert devices.world_size == 4
    assert [devices.bundle(rank) for rank in range(4)] == [("pg1", 0), ("pg1", 1), ("pg2", 0), ("pg2", 1)]


def _node(node_id, cpus, gpus=0, alive=True, address="10.0.0.1"):
    resources = {"CPU": cpus} | ({"GPU": gpus} if gpus else {})
    return {"NodeID": node_id, "Alive": alive, "NodeManagerAddress": address, "Resources": resources}


def test_pick_nodes_takes_nodes_with_room_driver_first():
    nodes = [_node("b", 8, address="10.0.0.2"), _node("a", 8, address="10.0.0.3"), _node("head", 2, address="10.0.0.1"),
             _node("dead", 64, alive=False)]
    bundle = device_bundle(on_cpu=True, colocate_count=3)
    assert [n["NodeID"] for n in pick_nodes(nodes, 2, 2, bundle, first_id="a")] == ["a", "b"]
    with pytest.raises(PlacementError) as info:
        pick_nodes(nodes, 3, 2, bundle, first_id="a")
    message = str(info.value)
    assert "trainer.nnodes=3 needs 3 Ray nodes with CPU 6 each" in message and "Ray has 2 such node(s)" in message
    assert "head (10.0.0.1): CPU 2" in message and "dead" in message
    gpu = device_bundle(on_cpu=False, colocate_count=1)
    with pytest.raises(PlacementError, match="GPU 8, CPU 8 each"):
        pick_nodes([_node("g", 64, gpus=4)], 1, 8, gpu)


def test_ray_joins_a_running_cluster_only_when_asked(monkeypatch):
    from async_rl.run_config import ray_init_kwargs

    config = OmegaConf.create({"trainer": {"device": "cpu", "nnodes": 2, "n_gpus_per_node": 2},
                               "actor_rollout_ref": {"rollout": {"name": "cpu"}}, "ray_kwargs": {"ray_init": {}}})
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    local = ray_init_kwargs(config)  # a fresh instance even if `ray start` left a cluster file behind
    assert local["address"] == "local" and local["num_cpus"] >= 16 and local["include_dashboard"] is False
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    joined = ray_init_kwargs(config)  # the cluster's resources are its own: none set here (Ray refuses them)
    assert "address" not in joined and "num_cpus" not in joined and "include_dashboard" not in joined
    monkeypatch.delenv("RAY_ADDRESS")
    config = OmegaConf.merge(config, {"ray_kwargs": {"ray_init": {"address": "auto"}}})
    assert ray_init_kwargs(config)["address"] == "auto" and "num_cpus" not in ray_init_kwargs(config)


def test_vllm_runs_keep_warnings(monkeypatch):
    """vLLM's API server sets the root logger to ERROR on import unless LOG_LEVEL is set: a vLLM run
    sets it for its workers (the user's own value wins); other backends are left alone."""
    from async_rl.run_config import ray_init_kwargs

    def env(name):
        config = OmegaConf.create({"trainer": {"device": "cpu", "nnodes": 1, "n_gpus_per_node": 2},
                                   "actor_rollout_ref": {"rollout": {"name": name}}, "ray_kwargs": {"ray_init": {}}})
        return ray_init_kwargs(config)["runtime_env"]["env_vars"]

    monkeypatch.delenv("LOG_LEVEL", raising=False)
    assert env("vllm")["LOG_LEVEL"] == "WARNING" and "LOG_LEVEL" not in env("cpu")
    monkeypatch.setenv("LOG_LEVEL", "INFO")
    assert env("vllm")["LOG_LEVEL"] == "INFO"


def test_env_vars_of_the_command_line_reach_ray_as_strings():
    """`+ray_kwargs.ray_init.runtime_env.env_vars.X=1` is an int to Hydra; Ray takes strings only."""
    from async_rl.run_config import ray_init_kwargs

    config = OmegaConf.create({"trainer": {"device": "cpu", "nnodes": 1, "n_gpus_per_node": 2},
                               "actor_rollout_ref": {"rollout": {"name": "cpu"}},
                               "ray_kwargs": {"ray_init": {"runtime_env": {"env_vars": {"X": 1, "Y": True}}}}})
    env_vars = ray_init_kwargs(config)["runtime_env"]["env_vars"]
    assert env_vars["X"] == "1" and env_vars["Y"] == "True"
