"""The generate stage against the policy clock (async_rl/core/policy_clock.py): each prompt batch is
admitted by the clock's gate (against its index, or the training batches formed under dynamic
sampling), the stage holds `gate.batches_ahead` batches, and a server a weight sync reports lost
through the clock reaches the stage's supervisor. No Ray: the clock runs in this process."""

from __future__ import annotations

import asyncio

from async_rl.core.messages import PromptBatch
from async_rl.core.policy_clock import ClockRef
from async_rl.core.staleness import StalenessGate
from helpers.lineage import compose_ppo
from helpers.scripted_server import ScriptedServer
from state_machines.base import END_OF_STREAM
from state_machines.generate import GenerateStage


def generate_stage(gate: StalenessGate) -> tuple[GenerateStage, ClockRef]:
    clock = ClockRef.in_process(gate)
    server = ScriptedServer(lambda kwargs, calls: ([5], 0, "completed"))
    return GenerateStage(servers=[server], config=compose_ppo([]), clock=clock), clock


async def admission(stage: GenerateStage, index: int) -> asyncio.Future:
    """Prompt batch `index` into the stage's inbox; the future of get_input_data handing it on."""
    await stage.put(PromptBatch(index, []))
    return asyncio.ensure_future(stage.get_input_data())


async def admitted_now(future: asyncio.Future) -> int:
    return (await asyncio.wait_for(future, 5.0)).index


async def still_waiting(future: asyncio.Future) -> bool:
    await asyncio.sleep(0.05)
    return not future.done()


def test_batches_are_admitted_against_the_served_version_and_the_stage_holds_eta_plus_one():
    stage, clock = generate_stage(StalenessGate(1))
    assert stage.inbox_size == stage.max_inflight == 2
    assert isinstance(stage.clock(), float)  # StateMachine.clock, the timeline's alignment, not shadowed

    async def main():
        stage.connect([], 1)
        for index in (0, 1):  # j <= 0 + 1
            assert await admitted_now(await admission(stage, index)) == index
        batch_2 = await admission(stage, 2)
        assert await still_waiting(batch_2)  # 2 <= 0 + 1 is false
        await clock.handle.set_served_version.remote(1)
        assert await admitted_now(batch_2) == 2

    asyncio.run(asyncio.wait_for(main(), 60))


def test_with_dynamic_sampling_batches_are_admitted_against_the_next_batch_to_form():
    stage, clock = generate_stage(StalenessGate(1, steps_formed_after_generation=True))

    async def main():
        stage.connect([], 1)
        for index in (7, 8):  # any index while batch 0 is the next to form: 0 <= 0 + 1
            assert await admitted_now(await admission(stage, index)) == index
        await clock.handle.set_steps_formed.remote(2)
        batch_9 = await admission(stage, 9)
        assert await still_waiting(batch_9)  # 2 <= 0 + 1 is false
        await clock.handle.set_served_version.remote(1)
        assert await admitted_now(batch_9) == 9

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_server_reported_lost_through_the_clock_reaches_the_supervisor():
    stage, clock = generate_stage(StalenessGate(0))
    server = stage.servers.handles[0]

    async def main():
        await stage.policy_clock.follow()
        await clock.handle.report_lost.remote(0, server, "ActorDiedError: gone", False)
        await asyncio.sleep(0.05)
        stage.connect([], 1)
        await stage.put(END_OF_STREAM)

    asyncio.run(asyncio.wait_for(main(), 60))
    # max_restarts=0: the supervisor fails the stage's next request, naming the replica and the cause
    assert "rollout replica 0 was lost (ActorDiedError: gone)" in str(stage.servers.failure)
