"""verl_patches/master_port.py: a worker group's rendezvous port below the kernel's ephemeral range."""

from __future__ import annotations

import random
import socket

import ray

from helpers.clusters import RAY_CALL_GUARD_S
from verl_patches.master_port import LOWEST_PORT, ephemeral_range, patch_master_port, pick_master_port


def test_the_port_is_free_and_below_the_ephemeral_range():
    low, _ = ephemeral_range()
    ports = {pick_master_port(random.Random(seed)) for seed in range(20)}
    assert all(LOWEST_PORT <= port < low for port in ports), ports
    assert len(ports) > 10  # at random: two groups starting together rarely meet
    with socket.socket() as s:
        s.bind(("", ports.pop()))  # free when returned


def test_a_taken_port_is_passed_over():
    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        taken = held.getsockname()[1]
        # a range of the taken port alone: nothing below it is free, so the kernel's choice (verl's own)
        assert pick_master_port(low=taken, high=taken + 1) != taken
        first = random.Random(7).randrange(LOWEST_PORT, ephemeral_range()[0])
    with socket.socket() as other:
        other.bind(("", first))
        other.listen()
        assert pick_master_port(random.Random(7)) != first  # the rng's first pick is taken: the next one


def test_verls_worker_groups_get_the_port_after_the_patch(ray_cluster):
    import verl.single_controller.ray.base as base

    before = base.get_master_addr_port
    try:
        patch_master_port()
        patch_master_port()  # once
        assert base.get_master_addr_port._async_rl_patched and base.get_master_addr_port is not before
        addr, port = ray.get(base.get_master_addr_port.remote(master_port_range=None), timeout=RAY_CALL_GUARD_S)
        assert addr and LOWEST_PORT <= int(port) < ephemeral_range()[0]
        # an explicit range keeps verl's search from its first port
        _, port = ray.get(base.get_master_addr_port.remote(master_port_range=[LOWEST_PORT + 5, LOWEST_PORT + 400]),
                          timeout=RAY_CALL_GUARD_S)
        assert LOWEST_PORT + 5 <= int(port) < LOWEST_PORT + 400
    finally:
        base.get_master_addr_port = before
