"""Resource split and the fail-fast placement check (async_rl/resources.py)."""

from __future__ import annotations

import pytest

from async_rl.config import read_async_config
from async_rl.resources import check_cluster_fits, devices_needed, split_world_sizes
from omegaconf import OmegaConf


def sizes(ratios, slots):
    return split_world_sizes(slots, read_async_config(OmegaConf.create({"trainer": {"use_nodes_ratios": ratios}})))


def test_split_floors_and_keeps_one_device_per_role():
    # 4 numbers: the critic (PPO's 5th role) shares the train fraction
    assert sizes([0.5, 0.5, 0.5, 0.5], 8) == {"train": 4, "logp": 4, "ref_logp": 4, "generate": 4, "critic": 4}
    assert sizes([0.5, 0.25, 0.1, 0.5], 4) == {"train": 2, "logp": 1, "ref_logp": 1, "generate": 2, "critic": 2}
    assert sizes([0.5, 0.25, 0.1, 0.5, 0.25], 8)["critic"] == 2


def test_devices_needed_counts_every_pool():
    world = {"train": 2, "logp": 1, "ref_logp": 3, "generate": 4}
    assert devices_needed(world, num_replicas=2, replica_devices=2, ref_enabled=True) == 2 + 1 + 3 + 4
    assert devices_needed(world, num_replicas=2, replica_devices=2, ref_enabled=False) == 2 + 1 + 4
    # pi_prox on the train ranks: no logp worker group
    assert devices_needed(world, num_replicas=2, replica_devices=2, ref_enabled=True, logp_enabled=False) == 2 + 3 + 4
    world["critic"] = 5  # counted only for a run with a critic
    assert devices_needed(world, num_replicas=2, replica_devices=2, ref_enabled=True) == 2 + 1 + 3 + 4
    assert devices_needed(world, num_replicas=2, replica_devices=2, ref_enabled=True, critic_enabled=True) == 2 + 1 + 3 + 5 + 4


def test_cluster_check_names_the_keys_to_change():
    check_cluster_fits(3, on_cpu=True, cluster_resources={"CPU": 16.0})
    with pytest.raises(RuntimeError) as info:
        check_cluster_fits(96, on_cpu=True, cluster_resources={"CPU": 16.0})
    message = str(info.value)
    assert "needs 96 worker processes" in message and "Ray has 16" in message
    assert "trainer.n_gpus_per_node" in message and "ray_kwargs.ray_init.num_cpus" in message
    with pytest.raises(RuntimeError, match="needs 12 GPUs .* Ray has 8"):
        check_cluster_fits(12, on_cpu=False, cluster_resources={"CPU": 64.0, "GPU": 8.0})
