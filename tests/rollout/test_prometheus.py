"""`rollout.prometheus.enable` under the flag: verl's `update_prometheus_config` writes the rollout replicas' server
addresses as Prometheus's `rollout` scrape targets, on every node of the run (here the test's Ray cluster)."""

from __future__ import annotations

import yaml

from async_rl.rollout.verl_replicas import announce_to_prometheus
from helpers.lineage import compose_ppo


class Replica:  # what verl's update_prometheus_config reads of a started RolloutReplica
    def __init__(self, address: str):
        self._server_address = address


def test_the_replicas_become_prometheuss_scrape_targets_only_when_enabled(demo_dir, tmp_path, ray_cluster):
    from async_rl.demo import demo_overrides

    path = tmp_path / "prometheus" / "prometheus.yml"
    keys = {"actor_rollout_ref.rollout.prometheus.file": str(path), "actor_rollout_ref.rollout.prometheus.port": 1}
    replicas = [Replica("10.0.0.2:8001"), Replica("10.0.0.2:8002")]
    announce_to_prometheus(compose_ppo(demo_overrides(demo_dir, extra=keys)), replicas)
    assert not path.exists()  # verl's default: enable=False
    keys["actor_rollout_ref.rollout.prometheus.enable"] = True
    announce_to_prometheus(compose_ppo(demo_overrides(demo_dir, extra=keys)), replicas)
    jobs = {job["job_name"]: job for job in yaml.safe_load(path.read_text())["scrape_configs"]}
    assert jobs["rollout"]["static_configs"] == [{"targets": ["10.0.0.2:8001", "10.0.0.2:8002"]}]
