"""logp stage: the proximal log-probs, those of the policy just before the update (verl's actor engine).

Batch j is trained by the update from version j, so its log-probs are computed with
version j: the stage waits until param_update has loaded it (decoupled PPO's pi_prox, and
verl's recomputed `old_log_probs`). It computes them only with
`algorithm.proximal_logp_workers=logp`; with `train` (the default) the train ranks compute
them right before their update (state_machines/actor_train.py) and this stage passes the
batch on, as it does in verl's bypass mode, where PPO's pi_old is the behaviour policy.

Why `train` is the default: version j exists only once update j - 1 is done, and update j
needs these log-probs, so the logp forward and the update always take turns; on the logp
workers that turn also waits for the weight hop, and the logp devices idle while training.

It is also a weight receiver (param_update/sync.py): buckets of the next version
are staged on its workers while they compute with the current one; the load waits for
the forward in progress and the next forward waits for the load, so a forward never
sees two versions.
"""

from __future__ import annotations

import asyncio

from async_rl.core.devices import world_size_of
from async_rl.core.messages import LogpResult, RolloutBatch
from async_rl.training import engine_calls
from async_rl.training.profiling import ProfiledSteps, ProfileWindows
from async_rl.training.worker_groups import make_worker_group
from param_update.holder import RelayedWeights
from state_machines.base import StateMachine


class LogpStage(StateMachine, RelayedWeights):
    """Recomputes response log-probs with the pre-update weights of their step (verl `compute_log_prob`).

    Args:
        config: the verl config.
        devices: the logp worker processes' devices (FSDP2 ranks; a GroupDevices or a count).
        consume_bucket_bytes: bytes loaded into the shards at a time.
        compute: False: pass batches on without log-probs (no worker group, no weights).
    """

    def __init__(self, *, config, devices, consume_bucket_bytes: int = 128 << 20, compute: bool = True):
        super().__init__("logp")
        self.config = config
        self.devices = devices
        self.world_size = world_size_of(devices)
        self.consume_bucket_bytes = consume_bucket_bytes
        self.temperature = float(config.actor_rollout_ref.rollout.temperature)
        self.worker_group = None
        self.profile = ProfileWindows(None, ProfiledSteps())  # verl's profiler windows, set up with the workers
        self.version = 0
        self._weights_in_use = asyncio.Lock()  # a forward or a load, never both
        self._version_loaded = asyncio.Condition()
        self.compute = compute

    def setup(self) -> int:
        """Start the worker group and its staging buffers (blocking; the driver calls it with a timeout)."""
        if not self.compute:
            return 0
        self.worker_group = make_worker_group(self.config, "actor", self.devices, "logp")
        self.profile = ProfileWindows(self.worker_group, ProfiledSteps.from_config(self.config), role="logp")
        self.worker_group.configure_weight_sync()
        return self.world_size

    def weight_digests(self) -> dict[str, str]:
        """name -> digest of the full weights this stage's workers hold (bit-identity checks)."""
        if self.worker_group is None:
            raise RuntimeError("the logp stage holds no weights (algorithm.proximal_logp_workers is not logp)")
        return self.worker_group.weight_digests()[0]

    # ---- weight receiver (param_update/holder.py `RelayedWeights`: staging on every worker) ----------
    async def commit_weights(self, version: int, num_buckets: int) -> dict:
        """load: waits for the forward in progress, then loads `version` into every rank."""
        loop = asyncio.get_running_loop()
        async with self._weights_in_use:
            start = loop.time()
            await asyncio.to_thread(self.worker_group.commit_weights, version, num_buckets, self.consume_bucket_bytes)
            self.version = version
            load_s = loop.time() - start
        async with self._version_loaded:
            self._version_loaded.notify_all()
        return {"load_s": load_s, "blocked_s": load_s, "keeps_buffer": False}  # copied into the shards

    # ---- the state machine -----------------------------------------------------------------

    async def process_data(self, data: RolloutBatch) -> LogpResult:
        if not self.compute:
            return LogpResult(index=data.index, batch_ref=data.batch_ref, old_log_probs=None, logp_version=-1)
        batch = await data.get()
        with self.waiting():  # for the trainer's version before it trains this batch: idle, not work
            async with self._version_loaded:
                await self._version_loaded.wait_for(lambda: self.version >= data.index)
        async with self._weights_in_use:
            version = self.version
            log_probs = await asyncio.to_thread(  # in verl's profiler window of its step, where listed
                self.profile.run, data.index + 1, engine_calls.compute_log_prob, self.worker_group, batch,
                self.temperature)
        return LogpResult(index=data.index, batch_ref=data.batch_ref, old_log_probs=log_probs, logp_version=version)
