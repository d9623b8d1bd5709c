"""verl's profilers under the flag (`global_profiler.*`, each role's `profiler.*`).

verl's trainer brackets each step of `global_profiler.steps` with `start_profile` / `stop_profile` on its worker
groups; each rank then writes a trace where its role's `profiler` section says so (`enable`, `all_ranks`,
`ranks`, `tool_config`): verl's workers decide. In the pipeline the groups work on different steps at once, so
each group's window holds that group's own work for the step: the train ranks' update, the pi_prox pass, the
reference pass, and the critic's values pass and update. With `profile_continuous_steps`, one window spans a
run of consecutive listed steps, as in verl. The tools that run here: `torch` and `torch_memory`
(`PROFILER_TOOLS`, async_rl/core/verl_keys.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from omegaconf import OmegaConf


@dataclass(frozen=True)
class ProfiledSteps:
    """The training steps (1-based, verl's global steps) verl's profilers record, and whether consecutive ones
    share one window."""

    steps: frozenset = frozenset()
    continuous: bool = False

    @classmethod
    def from_config(cls, config) -> ProfiledSteps:
        steps = OmegaConf.select(config, "global_profiler.steps", default=None) or ()
        return cls(frozenset(int(s) for s in steps),
                   bool(OmegaConf.select(config, "global_profiler.profile_continuous_steps", default=False)))

    def starts(self, step: int) -> bool:
        """A window opens at `step`."""
        return step in self.steps and not (self.continuous and step - 1 in self.steps)

    def stops(self, step: int) -> bool:
        """A window closes after `step`."""
        return step in self.steps and not (self.continuous and step + 1 in self.steps)


class ProfileWindows:
    """One worker group's profiler windows (verl's `start_profile(role=, profile_step=)` and
    `stop_profile(run_command=)` on every rank). `begin(step)` before the group's work for a step, `end(step)`
    after it; verl's finish command runs after the last listed step only, as in verl."""

    def __init__(self, worker_group, steps: ProfiledSteps, role: str | None = None):
        self.worker_group, self.steps, self.role = worker_group, steps, role
        self.open = False

    def begin(self, step: int) -> None:
        if self.steps.starts(step) and not self.open:
            self.worker_group.start_profile(**({"role": self.role} if self.role else {}), profile_step=step)
            self.open = True

    def end(self, step: int) -> None:
        if self.steps.stops(step) and self.open:
            self.worker_group.stop_profile(run_command=step == max(self.steps.steps))
            self.open = False

    @contextlib.asynccontextmanager
    async def window(self, step: int):
        """The window of `step` around an async block (verl's calls block: they run in a thread)."""
        await asyncio.to_thread(self.begin, step)
        try:
            yield
        finally:
            await asyncio.to_thread(self.end, step)

    def run(self, step: int, call, *args):
        """`call(*args)` inside the window of `step` (blocking: the stages run it in a thread)."""
        self.begin(step)
        try:
            return call(*args)
        finally:
            self.end(step)
