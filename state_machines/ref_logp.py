"""ref_logp stage: log-probs under the frozen reference policy (verl's ref engine).

Runs only when verl's config needs a reference policy (KL loss or KL in reward,
`verl.trainer.ppo.utils.need_reference_policy`); otherwise it passes batches through
with no reference log-probs, so the pipeline's shape does not change.
"""

from __future__ import annotations

import asyncio

from async_rl.core.devices import world_size_of
from async_rl.core.messages import RefLogpResult, RolloutBatch
from async_rl.training import engine_calls
from async_rl.training.profiling import ProfiledSteps, ProfileWindows
from async_rl.training.worker_groups import make_worker_group
from state_machines.base import StateMachine


class RefLogpStage(StateMachine):
    """verl `compute_ref_log_prob` on a separate worker group."""

    def __init__(self, *, config, devices, enabled: bool):
        super().__init__("ref_logp")
        self.config = config
        self.devices = devices  # a GroupDevices or a count
        self.world_size = world_size_of(devices)
        self.enabled = enabled
        self.temperature = float(config.actor_rollout_ref.rollout.temperature)
        self.worker_group = None
        self.profile = ProfileWindows(None, ProfiledSteps())  # verl's profiler windows, set up with the workers

    def setup(self) -> int:
        if self.enabled:
            self.worker_group = make_worker_group(self.config, "ref", self.devices, "ref")
            self.profile = ProfileWindows(self.worker_group, ProfiledSteps.from_config(self.config))
        return self.world_size if self.enabled else 0

    async def process_data(self, data: RolloutBatch) -> RefLogpResult:
        if not self.enabled:
            return RefLogpResult(index=data.index, ref_log_prob=None)
        batch = await data.get()
        ref = await asyncio.to_thread(self.profile.run, data.index + 1,  # in verl's profiler window of its step
                                      engine_calls.compute_ref_log_prob, self.worker_group, batch, self.temperature)
        return RefLogpResult(index=data.index, ref_log_prob=ref)
