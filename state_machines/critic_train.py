"""critic_train stage: verl's critic update, one step per batch, in batch order; it also owns the
critic's forward (the values stage asks it for the values of each batch).

The critic is verl's engine `TrainingWorker` for a value model (FSDP2), on its own share of the
devices (`trainer.use_nodes_ratios`' 5th number). Staleness rule: the values of batch j come
from critic version j, the critic after the updates of batches 0..j-1, which is what verl's
synchronous trainer computes them with. `compute_values(j)` therefore waits for update j - 1;
update j needs the advantages of batch j (from actor_train, which needs those values), so the
critic's forward and update take turns on its devices while the actor's update, the rollouts
and the log-prob passes run beside them. No value the critic trains on is older than the
critic it updates (metric `async/critic_version`: the version that computed batch j's values).

Checkpoints: `save_checkpoint(path, step)` waits for critic version `step` and saves it through
verl's own checkpoint manager (`global_step_N/critic`, verl's layout: verl's trainer resumes it).
"""

from __future__ import annotations

import asyncio
import os
import time

import torch

from async_rl.core.devices import world_size_of
from async_rl.core.messages import CriticBatch, resolve
from async_rl.training import engine_calls
from async_rl.training.profiling import ProfiledSteps, ProfileWindows
from async_rl.training.worker_groups import make_critic_worker_group
from state_machines.base import END_OF_STREAM, StateMachine

VERSION_WAIT_S = 1800.0  # a values call waits at most this long for the update before it


class CriticTrainStage(StateMachine):
    """verl's `update_critic` on the critic worker group; `compute_values` on the same workers (its
    busy ratio counts both: the critic devices' share of the wall time)."""

    def __init__(self, *, config, devices, start_step: int = 0):
        super().__init__("critic_train", inbox_size=2)
        self.config = config
        self.devices = devices  # a GroupDevices or a count
        self.world_size = world_size_of(devices)
        self.version = start_step  # critic updates done
        self.worker_group = None
        self.profile = ProfileWindows(None, ProfiledSteps())  # verl's profiler windows, set up with the workers
        self._version_changed = asyncio.Condition()
        self._workers = asyncio.Lock()  # one call on the critic workers at a time
        self._metrics: dict[int, dict[str, float]] = {}
        self._saves_pending: set[int] = set()  # steps whose checkpoint is asked for and not yet written

    def setup(self) -> int:
        self.worker_group = make_critic_worker_group(self.config, self.devices)
        self.profile = ProfileWindows(self.worker_group, ProfiledSteps.from_config(self.config))
        return self.world_size

    async def _at_version(self, version: int, what: str) -> None:
        async with self._version_changed:
            try:
                await asyncio.wait_for(self._version_changed.wait_for(lambda: self.version >= version),
                                       VERSION_WAIT_S)
            except asyncio.TimeoutError:
                raise RuntimeError(f"{what} waited {VERSION_WAIT_S:g} s for critic version {version} "
                                   f"(at {self.version})") from None
        if self.version != version:
            raise RuntimeError(f"{what} needs critic version {version}, the critic is already at {self.version}")

    async def compute_values(self, index: int, batch_ref) -> tuple[torch.Tensor, int, float]:
        """(values (bs, resp_len), the critic version that computed them, seconds of forward) of batch `index`."""
        await self._at_version(index, f"the values of batch {index}")
        batch = await resolve(batch_ref)
        async with self._workers:
            self.timer.enter()  # the critic's devices are busy: counted in this stage's busy ratio
            start = time.perf_counter()
            try:
                await asyncio.to_thread(self.profile.begin, index + 1)  # verl's profilers: values, then update
                values = await asyncio.to_thread(engine_calls.compute_values, self.worker_group, batch,
                                                 float(self.config.actor_rollout_ref.rollout.temperature))
            finally:
                self.timer.leave()
            return values, self.version, time.perf_counter() - start

    def load_checkpoint(self, path: str, del_local_after_load: bool = False) -> int:
        """verl's load_checkpoint of `path`/critic (model, optimizer, lr scheduler)."""
        critic_dir = os.path.join(path, "critic")
        if not os.path.isdir(critic_dir):
            raise FileNotFoundError(f"{critic_dir}: the checkpoint has no critic (saved by a run without one); "
                                    "resume it with the same algorithm.adv_estimator / critic.enable")
        self.worker_group.load_checkpoint(critic_dir, None, del_local_after_load)
        return self.version

    async def save_checkpoint(self, path: str, step: int) -> float:
        """Critic version `step` into `path` through verl's checkpoint manager; seconds spent saving.
        Asked for before actor_train sends batch `step`, so the update of that batch waits for it."""
        self._saves_pending.add(step)
        try:
            await self._at_version(step, f"the critic checkpoint of step {step}")
            async with self._workers:
                start = time.perf_counter()
                await asyncio.to_thread(self.worker_group.save_checkpoint, path, None, step, None)
                return time.perf_counter() - start
        finally:
            async with self._version_changed:
                self._saves_pending.discard(step)
                self._version_changed.notify_all()

    async def get_input_data(self):
        item = await self.next_from_inbox()
        if item is not END_OF_STREAM and item.index != self.version:
            raise RuntimeError(f"critic_train got batch {item.index} at critic version {self.version}")
        return item

    async def process_data(self, data: CriticBatch) -> None:
        async with self._version_changed:  # a checkpoint of this version is written before it changes
            await self._version_changed.wait_for(lambda: self.version not in self._saves_pending)
        batch = await resolve(data.batch_ref)  # None: every row of the step was filtered out, no update
        metrics = {}
        if batch is not None:
            async with self._workers:
                start = time.perf_counter()
                metrics = await asyncio.to_thread(engine_calls.update_critic, self.worker_group, batch, self.config)
                metrics["timing_s/update_critic"] = time.perf_counter() - start
        await asyncio.to_thread(self.profile.end, data.index + 1)
        self._metrics[data.index + 1] = metrics  # logged with global step index + 1
        async with self._version_changed:
            self.version += 1
            self._version_changed.notify_all()

    def pop_metrics(self) -> dict[int, dict[str, float]]:
        """global step -> verl's critic metrics of the update that made it, once each."""
        out, self._metrics = self._metrics, {}
        return out
