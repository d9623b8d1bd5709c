"""`master_port`: rank 0's rendezvous port outside the kernel's ephemeral range.

verl 0.9.1's `get_master_addr_port` (verl.single_controller.ray.base) binds port 0, which the kernel
takes from its ephemeral range (`/proc/sys/net/ipv4/ip_local_port_range`), closes it, and hands the
number to the worker group; rank 0's TCPStore binds it only once its workers have started and
loaded their modules, seconds later. Meanwhile every outgoing connection on the machine (Ray's gRPC
clients open many) may take that port as its local port, and rank 0 fails with EADDRINUSE (likelier the
more Ray clusters share the machine). A port below the ephemeral range is never
given to an outgoing connection; picked at random, two worker groups starting at once rarely pick the
same one. An explicit `master_port_range` keeps verl's own search.
"""

from __future__ import annotations

import random
import socket
from typing import Optional

import ray

# Ray's workers listen on 10002-19999 by default (`min_worker_port`, `max_worker_port`)
LOWEST_PORT = 20000
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
ATTEMPTS = 64


def ephemeral_range(path: str = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports, inclusive (Linux's default where unreadable)."""
    try:
        with open(path) as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def pick_master_port(rng: Optional[random.Random] = None, low: int = LOWEST_PORT,
                     high: Optional[int] = None) -> int:
    """A port in [low, high) (high: the ephemeral range's first port) that a socket can bind now, tried at
    random; falls back to an ephemeral one (verl's choice) when the range is empty or taken."""
    rng = rng or random.Random()
    high = ephemeral_range()[0] if high is None else high
    for _ in range(ATTEMPTS if high > low else 0):
        port = rng.randrange(low, high)
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        return port
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def patch_master_port() -> None:
    """Make verl's worker groups get their master port from `pick_master_port` (where no
    `master_port_range` is given); idempotent."""
    import verl.single_controller.ray.base as base

    if getattr(base.get_master_addr_port, "_async_rl_patched", False):
        return
    verls = base.get_master_addr_port

    @ray.remote
    def get_master_addr_port(master_port_range: Optional[list[int]] = None) -> tuple[str, str]:
        if master_port_range is not None:
            return verls._function(master_port_range)  # verl's search, in this task
        return ray.util.get_node_ip_address().strip("[]"), str(pick_master_port())

    get_master_addr_port._async_rl_patched = True
    base.get_master_addr_port = get_master_addr_port
