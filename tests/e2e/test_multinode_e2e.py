"""The demo on a 3-node local Ray cluster (`ray.cluster_utils.Cluster`): a head for the driver and
two job nodes of 2 devices each. `use_nodes_ratios=[0.5,0.5,0.5,0.5]` must put train and ref_logp
on one job node (sharing its devices) and both rollout replicas on the other, and every stage
beside its workers, the stages of a node in one process (`trainer.stage_processes=per_node`), and the
weights cross to the serving node in the collective transport's gloo group every step; a placement the
cluster cannot hold fails at start, naming the nodes."""

from __future__ import annotations

import pytest
import ray

from helpers.rows import every_step_with
from helpers.runs import run_verl

pytestmark = pytest.mark.slow

JOB = {"trainer.nnodes": 2, "trainer.n_gpus_per_node": 2, "actor_rollout_ref.actor.use_kl_loss": True,
       "trainer.test_freq": -1, "trainer.val_before_train": False}


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    # a job node: 2 devices x (train + ref_logp sharing each) = 4 logical CPUs
    workers = [cluster.add_node(num_cpus=4) for _ in range(2)]
    cluster.wait_for_nodes()
    yield cluster, cluster.head_node.node_id, {w.node_id for w in workers}
    ray.shutdown()
    cluster.shutdown()


def _actor_nodes(address: str) -> dict[str, str]:
    """Actor name -> the node id it ran on, for every named actor the cluster has seen."""
    ray.init(address=address)
    try:
        return {a["Name"]: a["Address"]["NodeID"] for a in ray._private.state.actors().values() if a["Name"]}
    finally:
        ray.shutdown()


def _named(nodes: dict[str, str], prefix: str, contains: str = "") -> dict[str, str]:
    return {name: node for name, node in nodes.items() if name.startswith(prefix) and contains in name}


def test_stages_and_workers_run_where_use_nodes_ratios_places_them(cluster, demo_dir, tmp_path, monkeypatch):
    ray_cluster, head, job_nodes = cluster
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster.address)
    steps = 3
    code, out, rows = run_verl(demo_dir, {**JOB, "trainer.total_training_steps": steps}, tmp_path)
    assert code == 0, out[-4000:]
    assert "placement: node 0: train x2, ref_logp x2; node 1: generate x2 replica(s)" in out
    by_step = every_step_with(rows, steps, ["critic/score/mean", "actor/kl_loss"])
    synced = {}  # a row carries the newest sync completed when it was logged: none yet on the first rows
    for step, metrics in by_step.items():
        assert metrics["async/param_version"] == step  # weights crossed nodes every step
        if "async/param_update/synced_version" in metrics:
            # in the collective group (gloo), both servers, nothing through the object store or shared memory
            synced[metrics["async/param_update/synced_version"]] = (
                metrics["async/param_update/collective_receivers"], metrics["async/param_update/store_receivers"],
                metrics["async/param_update/shm_receivers"])
        assert (metrics["async/devices/train"], metrics["async/devices/ref_logp"], metrics["async/devices/generate"],
                metrics["async/devices/shared"]) == (2.0, 2.0, 2.0, 1.0)
    # generate_ahead_steps=2: step 3's batch is generated on version 1 at least, so its row has a sync
    assert synced and set(synced.values()) == {(2.0, 0.0, 0.0)}, synced

    nodes = _actor_nodes(ray_cluster.address)
    train, ref = _named(nodes, "train", "PipelineWorker"), _named(nodes, "ref", "PipelineWorker")
    servers = _named(nodes, "cpu_rollout_server_")
    assert len(train) == len(ref) == len(servers) == 2, sorted(nodes)
    (train_node,) = set(train.values())
    (serve_node,) = set(servers.values())
    assert set(ref.values()) == {train_node}  # shared devices: same node as train
    assert {train_node, serve_node} == job_nodes  # two different job nodes, the head holds neither
    hosts = _named(nodes, "async_rl_")  # async_rl_<stage>+<stage>..._<driver pid>: one process per node
    assert sorted(hosts.values()) == sorted([head, train_node, serve_node]), hosts
    stages = {stage: node for name, node in hosts.items() for stage in name.split("_", 2)[2].rsplit("_", 1)[0].split("+")}
    assert {s: stages[s] for s in ("actor_train", "param_update", "ref_logp")} == dict.fromkeys(
        ("actor_train", "param_update", "ref_logp"), train_node)
    assert stages["generate"] == serve_node
    assert {stages[s] for s in ("dataloader", "rollout", "reward")} == {head}  # the driver's node


def test_more_nodes_than_the_cluster_has_fails_at_start_naming_them(cluster, demo_dir, tmp_path, monkeypatch):
    ray_cluster, head, _ = cluster
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster.address)
    # under the 300 s a placement may wait: the check comes before any placement group
    code, out, _ = run_verl(demo_dir, {**JOB, "trainer.nnodes": 4}, tmp_path, timeout_s=240)
    assert code != 0
    assert "trainer.nnodes=4 needs 4 Ray nodes with CPU 4 each" in out and "Ray has 2 such node(s)" in out
    assert f"{head[:8]} (" in out and "CPU 1" in out  # the head is listed with what it lacks


def test_a_ratio_fsdp_cannot_use_fails_before_ray(demo_dir, tmp_path):
    extra = [f"{key}={value}" for key, value in JOB.items()] + ["+trainer.use_nodes_ratios=[0.75,0.25,0.25,0.25]"]
    code, out, _ = run_verl(demo_dir, extra, tmp_path, timeout_s=120)
    assert code != 0
    assert "trainer.use_nodes_ratios gives train 3 devices (ratio 0.75) on nodes [0, 1]" in out
    assert "Started a local Ray instance" not in out
