"""The environment pool (async_rl/rollout/environment_pool.py) and the tools it bounds: trajectories share
a tool's environments, take one when they call and give it back when done; waits are measured and
bounded, naming `multi_turn.tool_pool_size`."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from omegaconf import open_dict

from async_rl.core.config import read_async_config
from async_rl.core.errors import AsyncConfigError
from async_rl.rollout.agent_loops import _TRAJECTORY, TrajectoryRecord, bound_tool_calls
from async_rl.rollout.environment_pool import TOOL_POOL_SIZE_KEY, EnvironmentPool, EnvironmentPoolTimeout


def test_a_trajectory_waits_for_a_free_environment_and_the_wait_is_measured():
    async def scenario():
        pool = EnvironmentPool("sandbox", 2, wait_timeout_s=5)
        assert await pool.acquire() < 0.05 and await pool.acquire() < 0.05 and pool.in_use == 2
        loop = asyncio.get_running_loop()
        loop.call_later(0.3, pool.release)  # a trajectory gives one back
        waited = await pool.acquire()
        assert 0.25 < waited < 2 and pool.in_use == 2

    asyncio.run(scenario())


def test_a_wait_past_the_bound_fails_naming_the_pool_and_the_key():
    async def scenario():
        pool = EnvironmentPool("sandbox", 1, wait_timeout_s=0.2)
        await pool.acquire()
        with pytest.raises(EnvironmentPoolTimeout, match=f"'sandbox' .* within 0.2 s: all 1 in use .*{TOOL_POOL_SIZE_KEY}"):
            await pool.acquire()
        pool.release()
        with pytest.raises(RuntimeError, match="release without an acquire"):
            pool.release()

    asyncio.run(scenario())


def function_tool_with_pool(size: int, seconds: float):
    """A verl FunctionTool taking `seconds` a call, bounded with a pool of `size`; and the most calls that
    ever ran at once."""
    from verl.tools.function_tool import FunctionTool
    from verl.tools.schemas import OpenAIFunctionToolSchema

    running, peak = [0], [0]

    async def search(query: str) -> str:
        running[0] += 1
        peak[0] = max(peak[0], running[0])
        await asyncio.sleep(seconds)
        running[0] -= 1
        return query

    schema = OpenAIFunctionToolSchema.model_validate(
        {"type": "function", "function": {"name": "search", "description": "searches",
                                          "parameters": {"type": "object", "properties": {}, "required": []}}})
    tool = FunctionTool(name="search", fn=search, tool_schema=schema, is_async=True)
    pool = EnvironmentPool("search", size, wait_timeout_s=10)
    bound_tool_calls(tool, 10, pool)
    return tool, pool, peak


def test_function_tool_calls_share_the_pool_across_trajectories_and_record_their_waits():
    async def trajectory(tool):
        record = TrajectoryRecord()
        _TRAJECTORY.set(record)  # each trajectory is its own task, as in verl's worker
        await tool.call({"query": "q"})
        return record.pool_wait_s

    async def scenario():
        tool, pool, peak = function_tool_with_pool(size=2, seconds=0.3)
        waits = await asyncio.gather(*(trajectory(tool) for _ in range(4)))
        return sorted(waits), peak[0], pool.in_use

    waits, peak, in_use = asyncio.run(scenario())
    assert peak == 2 and in_use == 0  # never more than the pool's size at once; all given back
    assert waits[:2] == pytest.approx([0, 0], abs=0.05) and all(0.2 < w < 2 for w in waits[2:])


def test_a_stateful_tool_holds_its_environment_from_create_to_release():
    from verl.tools.base_tool import BaseTool
    from verl.tools.schemas import OpenAIFunctionToolSchema

    class Sandbox(BaseTool):
        fail_next_create = False

        async def create(self, instance_id=None, **kwargs):
            if self.fail_next_create:
                raise RuntimeError("sandbox would not start")
            return await super().create(instance_id, **kwargs)

    schema = OpenAIFunctionToolSchema.model_validate(
        {"type": "function", "function": {"name": "sandbox", "description": "runs code",
                                          "parameters": {"type": "object", "properties": {}, "required": []}}})
    tool = Sandbox({}, schema)
    pool = EnvironmentPool("sandbox", 1, wait_timeout_s=0.2)
    bound_tool_calls(tool, 5, pool)

    async def scenario():
        instance, _ = await tool.create()
        await tool.execute(instance, {})
        assert pool.in_use == 1
        with pytest.raises(EnvironmentPoolTimeout):  # the one environment is taken until release
            await tool.create()
        await tool.release(instance)
        assert pool.in_use == 0
        tool.fail_next_create = True
        with pytest.raises(RuntimeError, match="would not start"):
            await tool.create()
        assert pool.in_use == 0  # a failed create gives its environment back

    asyncio.run(scenario())


def test_the_stage_gives_every_tool_its_own_pool_of_the_configured_size(demo_dir):
    from helpers.lineage import compose_ppo
    from async_rl.core.config import strip_async_keys
    from async_rl.demo import demo_overrides
    from async_rl.core.policy_clock import ClockRef
    from async_rl.core.staleness import StalenessGate
    from state_machines.generate import GenerateStage
    from helpers.scripted_server import ScriptedServer

    config = compose_ppo(demo_overrides(demo_dir))
    strip_async_keys(config)
    with open_dict(config.actor_rollout_ref.rollout.multi_turn):
        config.actor_rollout_ref.rollout.multi_turn.function_tool_path = str(Path(__file__).parent / "slow_tools.py")
    server = ScriptedServer(lambda kwargs, calls: ([5], None, "completed"))
    worker = GenerateStage(servers=[server], config=config, clock=ClockRef.in_process(StalenessGate(1)),
                           tool_timeout_s=0.5, tool_pool_size=3).agent_loops()
    assert {name: (pool.size, pool.wait_timeout_s) for name, pool in worker.pools.items()} == {"lookup_forever": (3, 0.5)}
    unlimited = GenerateStage(servers=[server], config=config, clock=ClockRef.in_process(StalenessGate(1))).agent_loops()
    assert unlimited.pools == {}


@pytest.mark.parametrize("value", [0, -1, 1.5, "four", True])
def test_a_pool_size_that_is_not_a_positive_integer_is_refused_naming_the_key(demo_dir, value):
    from helpers.lineage import compose_ppo
    from async_rl.demo import demo_overrides

    config = compose_ppo(demo_overrides(demo_dir, extra={f"+{TOOL_POOL_SIZE_KEY}": value}))
    with pytest.raises(AsyncConfigError, match=TOOL_POOL_SIZE_KEY):
        read_async_config(config)
