"""The raw link between two Ray nodes, as the weight sync's collective transport uses it: one gloo send of
n bytes from the calling process to a `LinkProbe` actor on the other node, until it has them."""

from __future__ import annotations

import datetime
import os
import time

import ray
import torch
import torch.distributed as dist

TIMEOUT_S = 900
REPOSITORY_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def two_node_cluster():
    """Starts a local Ray cluster of two 16-logical-CPU nodes and connects this process to it; returns the
    `ray.cluster_utils.Cluster` (the caller shuts it down). Its workers import this repository's code
    (`bench`, `param_update`, ...) whatever the caller's PYTHONPATH."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 16, "include_dashboard": False})
    cluster.add_node(num_cpus=16)
    cluster.wait_for_nodes()
    python_path = os.pathsep.join(p for p in (REPOSITORY_ROOT, os.environ.get("PYTHONPATH", "")) if p)
    ray.init(address=cluster.address,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": python_path}})
    return cluster


def node_ids(cluster) -> tuple[str, str]:
    """(head node, other node) ids of a `two_node_cluster`."""
    head = cluster.head_node.node_id
    return head, next(node.node_id for node in cluster.worker_nodes)


def gloo_send_s(nbytes: int, probe, repeats: int = 3) -> float:
    """The fastest of `repeats` gloo sends of `nbytes` from this process to `probe` (a LinkProbe), each timed
    until the probe acknowledges it (s)."""
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    store = dist.TCPStore(ray.util.get_node_ip_address(), 0, 2, True, timeout=timeout, wait_for_workers=False)
    joined = probe.receive.remote(ray.util.get_node_ip_address(), store.port, nbytes, repeats)
    group = dist.ProcessGroupGloo(dist.PrefixStore("raw", store), 0, 2, timeout)
    data, ack, times = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8), []
    for i in range(repeats):
        start = time.perf_counter()
        group.send([data], 1, 2 * i).wait()
        group.recv([ack], 1, 2 * i + 1).wait()
        times.append(time.perf_counter() - start)
    ray.get(joined, timeout=TIMEOUT_S)
    return min(times)


@ray.remote
class LinkProbe:
    """The receiving end of `gloo_send_s`, on the other node."""

    def receive(self, address: str, port: int, nbytes: int, repeats: int) -> None:
        timeout = datetime.timedelta(seconds=TIMEOUT_S)
        store = dist.TCPStore(address, port, 2, False, timeout=timeout)
        group = dist.ProcessGroupGloo(dist.PrefixStore("raw", store), 1, 2, timeout)
        data, ack = torch.empty(nbytes, dtype=torch.uint8), torch.ones(1, dtype=torch.uint8)
        for i in range(repeats):
            group.recv([data], 0, 2 * i).wait()
            group.send([ack], 0, 2 * i + 1).wait()
