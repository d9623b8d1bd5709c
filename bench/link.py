"""The raw link between two Ray nodes, as the weight sync's collective transport uses it: one gloo send of
n bytes from the calling process to a `LinkProbe` actor on the other node, until it has them."""

from __future__ import annotations

import datetime
import time

import ray
import torch
import torch.distributed as dist

TIMEOUT_S = 900


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
