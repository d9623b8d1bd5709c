"""state_machines/host.py: stages sharing one Ray actor process, called through `HostedStage` handles as
their own actors are; a constructor that raises is named by every call; the host's thread pool grows
with its stages."""

from __future__ import annotations

import asyncio
import os
import pickle
import threading

import pytest
import ray

from helpers.clusters import RAY_CALL_GUARD_S
from state_machines.base import END_OF_STREAM, StageError, StateMachine
from state_machines.host import THREADS_PER_STAGE, HostedStage, StageHost, StageNotBuilt


def _stage_classes():
    """Defined in a function so Ray pickles them by value (tests/ is not importable)."""

    class Numbers(StateMachine):
        def __init__(self, name, n):
            super().__init__(name)
            self.n, self.i = n, 0

        async def get_input_data(self):
            if self.i >= self.n:
                return END_OF_STREAM
            self.i += 1
            return self.i - 1

        async def process_data(self, data):
            return data

        def pid(self):
            return os.getpid()

    class Collect(StateMachine):
        barrier = None  # shared by the host's Collect stages: `parties` blocking calls meet there

        def __init__(self, name, fail_on=None, parties=0):
            super().__init__(name, inbox_size=max(parties, 1), max_inflight=max(parties, 1))
            self.fail_on, self.got = fail_on, []
            if parties and Collect.barrier is None:
                Collect.barrier = threading.Barrier(parties * 3, timeout=120)  # a hang guard

        async def process_data(self, data):
            if data == self.fail_on:
                raise ValueError(f"bad item {data}")
            if self.barrier is not None:  # a blocking call, as a worker group's, off the event loop
                await asyncio.to_thread(self.barrier.wait)
            self.got.append(data)

        def items(self):
            return self.got

        def pid(self):
            return os.getpid()

    class Broken(StateMachine):
        def __init__(self, name):
            raise OSError(f"no such file: {name}.parquet")

        async def process_data(self, data):
            return data

    return Numbers, Collect, Broken


def _host(stages: int):
    return ray.remote(StageHost).options(num_cpus=0, max_concurrency=64 * stages).remote(stages)


def test_two_stages_on_one_host_stream_through_their_handles(ray_cluster):
    Numbers, Collect, _ = _stage_classes()
    host = _host(2)
    ray.get([host.add.remote("numbers", Numbers, ("numbers", 50), {}),
             host.add.remote("collect", Collect, ("collect",), {})], timeout=RAY_CALL_GUARD_S)
    numbers, collect = HostedStage(host, "numbers"), HostedStage(host, "collect")
    # the handle travels to the other stage (pickled), which puts through it as through an actor handle
    ray.get([numbers.connect.remote([collect], 0), collect.connect.remote([], 1)], timeout=RAY_CALL_GUARD_S)
    stats = ray.get([numbers.run.remote(), collect.run.remote()], timeout=RAY_CALL_GUARD_S)
    assert [s["items"] for s in stats] == [50, 50] and [s["name"] for s in stats] == ["numbers", "collect"]
    assert ray.get(collect.items.remote(), timeout=RAY_CALL_GUARD_S) == list(range(50))
    pids = ray.get([numbers.pid.remote(), collect.pid.remote()], timeout=RAY_CALL_GUARD_S)
    assert pids[0] == pids[1]  # one process
    ray.kill(host)


def test_a_hosted_stage_failing_is_named_as_its_own_actor_would_be(ray_cluster):
    Numbers, Collect, _ = _stage_classes()
    host = _host(2)
    ray.get([host.add.remote("numbers", Numbers, ("numbers", 20), {}),
             host.add.remote("collect", Collect, ("failing-collect",), {"fail_on": 4})], timeout=RAY_CALL_GUARD_S)
    numbers, collect = HostedStage(host, "numbers"), HostedStage(host, "collect")
    ray.get([numbers.connect.remote([collect], 0), collect.connect.remote([], 1)], timeout=RAY_CALL_GUARD_S)
    collect_run, numbers_run = collect.run.remote(), numbers.run.remote()
    with pytest.raises(StageError) as info:
        ray.get(collect_run, timeout=RAY_CALL_GUARD_S)
    assert info.value.cause.stage == "failing-collect" and "ValueError: bad item 4" in str(info.value)
    assert ray.get(collect.items.remote(), timeout=RAY_CALL_GUARD_S) == [0, 1, 2, 3]
    ray.get(numbers.stop.remote(), timeout=RAY_CALL_GUARD_S)  # its neighbour on the host still answers
    ray.kill(host)


def test_a_constructor_that_raises_is_named_by_its_add_and_every_call(ray_cluster):
    _, _, Broken = _stage_classes()
    host = _host(1)
    with pytest.raises(StageNotBuilt, match=r"stage 'reward' \(Broken\) failed to start: OSError: no such file: reward"):
        ray.get(host.add.remote("reward", Broken, ("reward",), {}), timeout=RAY_CALL_GUARD_S)
    with pytest.raises(StageNotBuilt, match="stage 'reward' failed to start: OSError: no such file: reward.parquet"):
        ray.get(HostedStage(host, "reward").stats.remote(), timeout=RAY_CALL_GUARD_S)
    with pytest.raises(StageNotBuilt, match="stage 'logp' failed to start: it was never added to this host"):
        ray.get(HostedStage(host, "logp").stats.remote(), timeout=RAY_CALL_GUARD_S)
    ray.kill(host)


def test_the_hosts_thread_pool_holds_each_stages_blocking_calls(ray_cluster):
    """Three stages each with THREADS_PER_STAGE blocking calls in threads at once, which return only when
    all of them are blocked (a barrier): asyncio's default pool (6 threads on 2 cores) would hold 6 and
    the barrier would break; the host's pool holds them all."""
    Numbers, Collect, _ = _stage_classes()
    host = _host(6)
    adds = []
    for i in range(3):
        adds += [host.add.remote(f"numbers{i}", Numbers, (f"numbers{i}", THREADS_PER_STAGE), {}),
                 host.add.remote(f"collect{i}", Collect, (f"collect{i}",), {"parties": THREADS_PER_STAGE})]
    ray.get(adds, timeout=RAY_CALL_GUARD_S)
    wires = []
    for i in range(3):
        collect = HostedStage(host, f"collect{i}")
        wires += [HostedStage(host, f"numbers{i}").connect.remote([collect], 0), collect.connect.remote([], 1)]
    ray.get(wires, timeout=RAY_CALL_GUARD_S)
    runs = [HostedStage(host, f"{kind}{i}").run.remote() for i in range(3) for kind in ("numbers", "collect")]
    stats = ray.get(runs, timeout=RAY_CALL_GUARD_S)
    assert [s["items"] for s in stats] == [THREADS_PER_STAGE] * 6
    ray.kill(host)


def test_a_hosted_stage_pickles_as_its_host_and_name():
    handle = HostedStage("a host's handle", "generate")
    again = pickle.loads(pickle.dumps(handle))
    assert (again.host, again.name) == ("a host's handle", "generate") and repr(again) == "HostedStage('generate')"
    with pytest.raises(AttributeError):
        again.__deepcopy__  # noqa: B018 - a dunder is not a stage method
