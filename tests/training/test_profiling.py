"""verl's profiler windows under the flag: which steps open and close a worker group's window (verl's
`global_profiler.steps`, `profile_continuous_steps`), the finish command on the last listed step only, and the
tools refused before Ray starts."""

from __future__ import annotations

import pytest

from async_rl.core.errors import AsyncConfigError
from async_rl.core.verl_keys import refuse_unsupported
from async_rl.training.profiling import ProfiledSteps, ProfileWindows
from helpers.lineage import compose_ppo


class RecordingGroup:
    """A worker group's `start_profile` / `stop_profile`, recorded."""

    def __init__(self):
        self.calls = []

    def start_profile(self, **kwargs):
        self.calls.append(("start", kwargs))

    def stop_profile(self, run_command):
        self.calls.append(("stop", {"run_command": run_command}))


def windows(steps, continuous, work_steps=range(1, 7)):
    group = RecordingGroup()
    profile = ProfileWindows(group, ProfiledSteps(frozenset(steps), continuous), role="train")
    done = [profile.run(step, lambda s=step: s) for step in work_steps]
    assert done == list(work_steps)
    return group.calls


def test_each_listed_step_is_a_window_of_its_own_and_the_last_runs_the_finish_command():
    assert windows({2, 3, 5}, continuous=False) == [
        ("start", {"role": "train", "profile_step": 2}), ("stop", {"run_command": False}),
        ("start", {"role": "train", "profile_step": 3}), ("stop", {"run_command": False}),
        ("start", {"role": "train", "profile_step": 5}), ("stop", {"run_command": True})]


def test_continuous_steps_share_one_window():
    assert windows({2, 3, 5}, continuous=True) == [
        ("start", {"role": "train", "profile_step": 2}), ("stop", {"run_command": False}),
        ("start", {"role": "train", "profile_step": 5}), ("stop", {"run_command": True})]


def test_no_listed_step_no_window_and_a_failing_step_still_closes_its_window():
    assert windows(set(), continuous=False) == []
    group = RecordingGroup()
    profile = ProfileWindows(group, ProfiledSteps(frozenset({1})))

    def fails():
        raise RuntimeError("the update failed")

    with pytest.raises(RuntimeError, match="the update failed"):
        profile.run(1, fails)
    assert group.calls == [("start", {"profile_step": 1}), ("stop", {"run_command": True})]


def test_steps_come_from_verls_keys(demo_dir):
    from async_rl.demo import demo_overrides

    config = compose_ppo(demo_overrides(demo_dir, extra={"global_profiler.steps": [4, 1],
                                                         "global_profiler.profile_continuous_steps": True}))
    assert ProfiledSteps.from_config(config) == ProfiledSteps(frozenset({1, 4}), True)
    assert ProfiledSteps.from_config(compose_ppo(demo_overrides(demo_dir))) == ProfiledSteps()


@pytest.mark.parametrize("tool,refused", [("torch", False), ("torch_memory", False), ("nsys", True), ("npu", True)])
def test_the_tools_that_do_not_run_here_are_refused_naming_the_key(demo_dir, tool, refused):
    from async_rl.demo import demo_overrides

    config = compose_ppo(demo_overrides(demo_dir, extra={"global_profiler.tool": tool, "global_profiler.steps": [1],
                                                         "actor_rollout_ref.actor.profiler.enable": True}))
    if refused:
        with pytest.raises(AsyncConfigError, match=f"global_profiler.tool='{tool}'; allowed: torch or torch_memory"):
            refuse_unsupported(config)
    else:
        refuse_unsupported(config)


def test_an_async_block_runs_inside_its_steps_window():
    import asyncio

    group = RecordingGroup()
    profile = ProfileWindows(group, ProfiledSteps(frozenset({3})), role="train")

    async def steps():
        for step in (2, 3):
            async with profile.window(step):
                group.calls.append(("work", {"step": step}))

    asyncio.run(steps())
    assert group.calls == [("work", {"step": 2}), ("start", {"role": "train", "profile_step": 3}),
                           ("work", {"step": 3}), ("stop", {"run_command": True})]
