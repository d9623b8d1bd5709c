"""Rollout replicas lost and restarted (async_rl/rollout/supervisor.py), with fake servers: the
request path of the generate stage (`generate_resumable`) rides through a dead or hung server,
and what cannot be survived stops with an error naming the replica and the key."""

from __future__ import annotations

import asyncio

import pytest
import ray
from verl.workers.rollout.replica import TokenOutput

from async_rl.core.config import AsyncConfigError, read_async_config
from async_rl.rollout.requests import generate_resumable
from async_rl.rollout.supervisor import ReplicaLostError, ReplicaSupervisor

PARAMS = {"temperature": 1.0, "max_tokens": 4}


class FakeServer:
    """A server handle: `generate.remote(**kw)` answers with `reply(kw)`; `dead` raises ActorDiedError,
    `hang` never answers."""

    def __init__(self, name: str, version: int = 0):
        self.name, self.version = name, version
        self.calls: list[dict] = []
        self.dead = self.hang = False
        server = self

        class _Generate:
            @staticmethod
            async def remote(**kwargs):
                server.calls.append(kwargs)
                if server.dead:
                    raise ray.exceptions.ActorDiedError()
                if server.hang:
                    await asyncio.sleep(3600)
                left = kwargs["sampling_params"]["max_tokens"]
                return TokenOutput(token_ids=[server.version + 10] * left, log_probs=[-0.5] * left,
                                   stop_reason="completed", extra_fields={"global_steps": server.version})

        self.generate = _Generate()


class Restarts:
    """relaunch / feed_weights / kill for the supervisor, recording the order of events."""

    def __init__(self, version: int = 7, fail_relaunch: bool = False):
        self.events: list[tuple] = []
        self.version, self.fail_relaunch = version, fail_relaunch
        self.started: list[FakeServer] = []

    async def relaunch(self, index: int, attempt: int):
        if self.fail_relaunch:
            raise RuntimeError("no resources for the new server")
        await asyncio.sleep(0.05)
        server = FakeServer(f"restart{attempt}_of_{index}", version=-1)  # serves nothing yet
        self.started.append(server)
        self.events.append(("relaunch", index, attempt))
        return server

    async def feed_weights(self, index: int, handle) -> int:
        await asyncio.sleep(0.05)
        handle.version = self.version  # the newest weights, loaded before it serves
        self.events.append(("fed", index, handle.name))
        return self.version

    def kill(self, handle) -> None:
        self.events.append(("kill", handle.name))


def supervisor(servers, restarts: Restarts, max_restarts: int = 2) -> ReplicaSupervisor:
    return ReplicaSupervisor(servers, max_restarts, restarts.relaunch, restarts.feed_weights, restarts.kill,
                             restart_timeout_s=10)


def run(coro, timeout_s: float = 20):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def one_request_then_settle(servers, restarts: Restarts, prompt: list[int], timeout_s: float, version: int):
    """(pool, response) of one request on replica 0, after the restart it caused finished in the background."""

    async def main():
        pool = supervisor(servers, restarts)
        out = await generate_resumable(pool, 0, prompt, PARAMS, timeout_s, served_version=version)
        await asyncio.sleep(0.3)
        return pool, out

    return run(main())


def test_a_dead_server_is_restarted_with_the_newest_weights_and_the_request_goes_to_a_survivor():
    servers = [FakeServer("a", version=7), FakeServer("b", version=7)]
    servers[0].dead = True
    restarts = Restarts(version=7)

    pool, out = one_request_then_settle(servers, restarts, [1, 2], 5.0, version=7)
    assert out.token_ids == [17] * 4 and out.token_versions == [7] * 4  # from survivor b, all tokens once
    assert len(servers[1].calls) == 1 and servers[1].calls[0]["prompt_ids"] == [1, 2]
    assert restarts.events == [("relaunch", 0, 1), ("fed", 0, "restart1_of_0")]  # weights before serving
    assert pool.handles[0] is restarts.started[0] and pool.ready(0)
    assert pool.counts() == {"async/faults/replica_restarts": 1.0, "async/faults/requests_resubmitted": 1.0}


def test_with_one_replica_requests_wait_for_the_restart_and_never_reach_a_server_without_weights():
    servers = [FakeServer("only", version=3)]
    servers[0].dead = True
    restarts = Restarts(version=3)

    async def main():
        pool = supervisor(servers, restarts)
        outs = await asyncio.gather(*(generate_resumable(pool, 0, [i], PARAMS, 5.0, served_version=3) for i in range(4)))
        return pool, outs

    pool, outs = run(main())
    new = restarts.started[0]
    assert len(restarts.started) == 1  # four failed requests, one restart
    assert all(out.token_ids == [13] * 4 for out in outs)  # every token from version 3, none from version -1
    assert sorted(c["prompt_ids"][0] for c in new.calls) == [0, 1, 2, 3]
    assert pool.counts()["async/faults/requests_resubmitted"] == 4.0


def test_tokens_from_before_the_loss_are_kept_and_only_the_rest_is_asked_for():
    """An aborted segment (a weight load) then a dead server: the second resubmission carries the
    first segment's tokens and asks for the remaining budget only."""
    first = FakeServer("a", version=1)
    calls = []

    class AbortThenDie:
        class generate:  # noqa: N801 - mimics a Ray actor method
            @staticmethod
            async def remote(**kwargs):
                calls.append(kwargs)
                if len(calls) == 1:
                    return TokenOutput(token_ids=[5], log_probs=[-0.1], stop_reason="aborted",
                                       extra_fields={"global_steps": 1})
                raise ray.exceptions.ActorDiedError()

    restarts = Restarts(version=2)

    async def main():
        pool = supervisor([AbortThenDie, first], restarts)
        return await generate_resumable(pool, 0, [1, 2], PARAMS, 5.0, served_version=1)

    out = run(main())
    assert out.token_ids == [5, 11, 11, 11] and out.token_versions == [1, 1, 1, 1]
    assert first.calls[0]["prompt_ids"] == [1, 2, 5] and first.calls[0]["sampling_params"]["max_tokens"] == 3


def test_a_hung_server_is_killed_after_the_request_timeout_and_restarted():
    servers = [FakeServer("hung", version=2), FakeServer("ok", version=2)]
    servers[0].hang = True
    restarts = Restarts(version=2)

    pool, out = one_request_then_settle(servers, restarts, [4], 0.2, version=2)
    assert out.token_ids == [12] * 4
    assert restarts.events[0] == ("kill", "hung") and ("relaunch", 0, 1) in restarts.events
    assert pool.counts()["async/faults/replica_restarts"] == 1.0


def test_without_restarts_a_lost_server_stops_the_run_naming_the_replica_and_the_key():
    servers = [FakeServer("a"), FakeServer("b")]
    servers[1].dead = True
    pool = ReplicaSupervisor(servers, 0)
    with pytest.raises(ReplicaLostError) as info:
        run(generate_resumable(pool, 1, [1], PARAMS, 5.0, served_version=0))
    message = str(info.value)
    assert "rollout replica 1 was lost (ActorDiedError" in message
    assert "actor_rollout_ref.rollout.max_restarts=0" in message


def test_a_replica_that_keeps_dying_stops_the_run_naming_it():
    servers = [FakeServer("a", version=1), FakeServer("b", version=1)]
    servers[0].dead = True
    restarts = Restarts(version=1)

    async def relaunch_dead(index, attempt):  # every new server of replica 0 dies too
        server = await Restarts.relaunch(restarts, index, attempt)
        server.dead = True
        return server

    restarts_kw = ReplicaSupervisor(servers, 1, relaunch_dead, restarts.feed_weights, restarts.kill, 10)

    async def main():
        await generate_resumable(restarts_kw, 0, [1], PARAMS, 5.0, served_version=1)  # b answers; 0 restarts
        await asyncio.sleep(0.3)
        await generate_resumable(restarts_kw, 0, [1], PARAMS, 5.0, served_version=1)  # restarted 0 dies again

    with pytest.raises(ReplicaLostError) as info:
        run(main())
    message = str(info.value)
    assert "rollout replica 0 was lost 2 times" in message and "max_restarts=1 restarts allowed" in message


def test_a_failed_restart_stops_the_requests_waiting_for_it():
    servers = [FakeServer("only")]
    servers[0].dead = True
    restarts = Restarts(fail_relaunch=True)
    with pytest.raises(ReplicaLostError) as info:
        run(generate_resumable(supervisor(servers, restarts), 0, [1], PARAMS, 5.0, served_version=0))
    assert "its restart 1 failed: RuntimeError: no resources for the new server" in str(info.value)


def test_a_second_report_of_the_same_loss_restarts_once():
    servers = [FakeServer("a"), FakeServer("b")]
    restarts = Restarts()

    async def main():
        pool = supervisor(servers, restarts)
        pool.lost(0, servers[0], "seen by generate")
        pool.lost(0, servers[0], "seen by param_update")  # same handle, restart under way
        await asyncio.sleep(0.3)
        pool.lost(0, servers[0], "late report about the old handle")  # already replaced
        return pool

    pool = run(main())
    assert pool.restarts == [1, 0] and len(restarts.started) == 1


# ---- keys -------------------------------------------------------------------------------------


def keys(**values):
    """The restart keys as the driver resolves them: read, then the rollout backend's default and check."""
    from omegaconf import OmegaConf

    from async_rl.api.rollout import rollout_backend
    from async_rl.run_config import _replica_restarts

    name = values.pop("name", "cpu")
    settings = read_async_config(OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": name, **values}}}))
    return settings.replica_max_restarts, _replica_restarts(settings, rollout_backend(name)), settings.request_timeout_s


def test_restart_keys_default_and_validation():
    assert keys() == (None, 3, 600.0)  # unset: the backend's default
    assert keys(name="vllm")[1] == 0  # opt in on verl's vLLM replicas (a weight copy is kept)
    assert keys(name="vllm", max_restarts=2)[1] == 2
    assert keys(max_restarts=0)[1] == 0
    with pytest.raises(AsyncConfigError, match=r"actor_rollout_ref\.rollout\.max_restarts=-1"):
        keys(max_restarts=-1)
    with pytest.raises(AsyncConfigError, match=r"max_restarts=2.*rollout\.name='sglang'.*not restarted"):
        keys(name="sglang", max_restarts=2)
    with pytest.raises(AsyncConfigError, match=r"actor_rollout_ref\.rollout\.request_timeout_s=0"):
        keys(request_timeout_s=0)


def test_validation_gets_every_replica_once_the_restart_is_done():
    servers = [FakeServer("a"), FakeServer("b")]
    restarts = Restarts()

    async def main():
        pool = supervisor(servers, restarts)
        pool.lost(1, servers[1], "killed")
        return await pool.all_ready()

    handles = run(main())
    assert handles[0] is servers[0] and handles[1] is restarts.started[0]


def test_a_report_carrying_an_equal_handle_from_another_process_counts():
    """param_update reports a lost server with its own copy of the handle (Ray handles compare by actor
    id, never by identity across processes); the report must still restart the replica, killing it
    when it hung."""

    class Handle(FakeServer):
        def __eq__(self, other):
            return isinstance(other, Handle) and other.name == self.name

        __hash__ = None

    servers = [Handle("a"), Handle("b")]
    restarts = Restarts()

    async def main():
        pool = supervisor(servers, restarts)
        pool.lost(1, Handle("b"), "no answer to register-buffer of version 3 within 30 s", hung=True)
        await asyncio.sleep(0.3)
        return pool

    pool = run(main())
    assert restarts.events[0] == ("kill", "b") and pool.restarts == [0, 1] and pool.handles[1] is restarts.started[0]


def test_the_timeline_shows_each_replicas_serving_periods_its_loss_and_its_restart():
    from async_rl.core.trace import TraceRecorder

    servers = [FakeServer("a", version=7), FakeServer("b", version=7)]
    servers[0].dead = True
    restarts = Restarts(version=7)
    recorder = TraceRecorder("stage generate", enabled=True)

    async def main():
        pool = ReplicaSupervisor(servers, 2, restarts.relaunch, restarts.feed_weights, restarts.kill,
                                 restart_timeout_s=10, trace=recorder)
        await asyncio.gather(*(generate_resumable(pool, 1, [i], PARAMS, 5.0, served_version=7) for i in range(3)))
        await generate_resumable(pool, 0, [9], PARAMS, 5.0, served_version=7)  # a dies: lost, goes to b
        await asyncio.sleep(0.3)  # the restart finishes
        await generate_resumable(pool, 0, [9], PARAMS, 5.0, served_version=7)  # the restarted a serves

    run(main())
    events = [(e[0], e[1], e[4]) for e in recorder.pop()["events"]]
    on_b = [args for track, name, args in events if track == "replica 1" and name == "serving"]
    assert on_b[0] == {"items": 3}  # three overlapping requests: one period
    replica_a = [(name, args.get("items", args.get("attempt"))) for track, name, args in events if track == "replica 0"]
    assert [name for name, _ in replica_a] == ["serving", "lost", "restart", "serving"], replica_a
    assert replica_a[2] == ("restart", 1)
