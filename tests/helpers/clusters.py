"""Ray for the tests: the guard on one Ray call, and the one-node cluster the session fixtures start
(tests/conftest.py)."""

from __future__ import annotations


# A hang guard for one Ray call in a test, not a performance bound: a new actor's first answer includes its
# process start and imports, which can take over 60 s on 2 cores saturated by the test lanes.
RAY_CALL_GUARD_S = 300


def start_cluster(**system_config):
    """A one-node Ray cluster (`ray.cluster_utils.Cluster`): 32 logical CPUs (stages mostly wait), 8 logical
    GPUs (verl's trainer and vLLM's CPU build count devices as GPUs), a 2 GiB object store, no dashboard."""
    from ray._common.utils import reset_ray_address
    from ray.cluster_utils import Cluster

    from async_rl.pipeline import retry_ray_start

    args = {"num_cpus": 32, "num_gpus": 8, "include_dashboard": False, "object_store_memory": 2 << 30}
    if system_config:
        args["_system_config"] = system_config
    cluster = retry_ray_start(lambda: Cluster(initialize_head=True, head_node_args=args))  # Ray's 30 s, on a loaded machine
    reset_ray_address()  # Cluster advertises itself to every later `ray.init()` on this machine
    return cluster
