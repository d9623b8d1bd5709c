"""generate stage: admits prompt batches under the staleness bound and samples responses.

Talks to rollout servers only through verl's server interface (`generate` on the
server handle of a `RolloutReplica`), so the CPU backend, sglang and vllm are
interchangeable. Each batch's n samples per prompt are spread round-robin over the
servers; up to `generate_ahead_steps` batches are in flight, each admitted only when
AReaL's rule allows it (`async_rl.core.staleness`).
"""

from __future__ import annotations

import asyncio
import uuid

from async_rl.core.fault_points import hold_at
from async_rl.core.messages import GeneratedBatch, PromptBatch, Sample
from async_rl.core.staleness import StalenessController
from async_rl.rollout.requests import Response, generate_resumable, sampling_params_from_config
from async_rl.rollout.supervisor import ReplicaSupervisor
from state_machines.base import StateMachine


class GenerateStage(StateMachine):
    """Samples `n` responses per prompt on the rollout servers, within the staleness bound."""

    def __init__(
        self, servers, rollout_cfg, max_staleness: int, request_timeout_s: float = 600.0, dynamic_sampling: bool = False,
        steps_formed: int = 0, replicas=None, max_restarts: int = 0, relaunch=None,
    ):
        """`dynamic_sampling`: batch indices are not training steps; a batch is admitted while the next
        training batch to form (`set_steps_formed`; `steps_formed` at start) is within the staleness bound.
        `replicas` (verl RolloutReplica objects behind `servers`), `relaunch` (the backend's
        `async relaunch(replica, attempt) -> server handle`, async_rl/api/rollout.py) and `max_restarts`:
        a lost server is restarted up to that many times (async_rl/rollout/supervisor.py); the new one
        gets its weights from the param_update stage (`attach_weight_source`)."""
        super().__init__("generate", inbox_size=max_staleness + 1, max_inflight=max_staleness + 1)
        if not servers:
            raise ValueError("generate stage needs at least one rollout server")
        self.replicas = list(replicas) if replicas is not None else None
        self._replica_relaunch = relaunch
        self._weight_source = None
        restartable = bool(max_restarts) and self.replicas is not None and relaunch is not None
        self.servers = ReplicaSupervisor(
            list(servers), max_restarts if restartable else 0,
            relaunch=self._relaunch if restartable else None,
            feed_weights=self._feed_weights if restartable else None,
        )
        self.n = int(rollout_cfg.n)
        self.sampling_params = sampling_params_from_config(rollout_cfg)
        self.staleness = StalenessController(max_staleness)
        self.request_timeout_s = request_timeout_s
        self._next_server = 0
        self.dynamic_sampling = dynamic_sampling
        self.steps_formed = steps_formed

    # ---- rollout servers: restarts (async_rl/rollout/supervisor.py) --------------------------
    def attach_weight_source(self, param_update) -> None:
        """The param_update stage, which loads the newest weights into a restarted server."""
        self._weight_source = param_update

    async def _relaunch(self, index: int, attempt: int):
        return await self._replica_relaunch(self.replicas[index], attempt)

    async def _feed_weights(self, index: int, handle) -> int:
        if self._weight_source is None:
            raise RuntimeError("no param_update stage attached to load the weights into the new server")
        replica = self.replicas[index]  # its actors now: verl's replicas' new workers load the weights
        actors = (list(replica.workers), list(replica.servers))
        return await self._weight_source.replace_rollout_server.remote(index, handle, actors)

    def server_lost(self, index: int, handle, cause: str, hung: bool = False) -> None:
        """Reported by param_update when a server failed (or, `hung`, stopped answering) during a weight sync."""
        try:
            self.servers.lost(index, handle, cause, hung=hung)
        except Exception:  # noqa: BLE001 - the failure is kept; the next request raises it in this stage
            pass

    async def server_handles(self) -> list:
        """The current server of every replica, once none is restarting (validation uses them)."""
        return await self.servers.all_ready()

    async def generate_many(self, prompts: list[list[int]], sampling_params: dict) -> list[Response]:
        """One response per prompt, spread over the replicas through the same supervised path as
        training requests (validation uses it)."""
        served = self.staleness.served_version
        return await asyncio.gather(*(
            generate_resumable(self.servers, i % len(self.servers.handles), prompt, sampling_params,
                               self.request_timeout_s, served)
            for i, prompt in enumerate(prompts)))

    def fault_counts(self) -> dict[str, float]:
        """Cumulative `async/faults/replica_restarts` and `async/faults/requests_resubmitted`."""
        return self.servers.counts()

    async def set_steps_formed(self, steps: int) -> None:
        """Called by the dynamic_sampling stage each time it forms a training batch."""
        self.steps_formed = steps
        await self.staleness.notify()

    async def set_served_version(self, version: int) -> None:
        """Called by param_update once every server serves `version`."""
        await self.staleness.set_served_version(version)

    def served_version(self) -> int:
        return self.staleness.served_version

    async def get_input_data(self):
        item = await self.next_from_inbox()
        if isinstance(item, PromptBatch):
            # Admission happens here, in input order, so batch j never overtakes j-1.
            if self.dynamic_sampling:
                await self.staleness.wait_until(lambda: self.staleness.may_start(self.steps_formed))
            else:
                await self.staleness.wait_until_admitted(item.index)
        return item

    def _pick_server(self) -> int:
        index = self._next_server % len(self.servers.handles)
        self._next_server += 1
        return index

    async def process_data(self, batch: PromptBatch) -> GeneratedBatch:
        start_version = self.staleness.served_version
        jobs, meta = [], []
        for prompt_ids, non_tensor in zip(batch.prompt_ids, batch.non_tensor):
            uid = uuid.uuid4().hex
            for _ in range(self.n):
                jobs.append(generate_resumable(self.servers, self._pick_server(), prompt_ids, self.sampling_params,
                                               self.request_timeout_s, start_version))
                meta.append((uid, prompt_ids, non_tensor))
        outputs = await asyncio.gather(*jobs)
        if batch.index > self.staleness.served_version:  # generated ahead of the trainer
            hold_at("generate_ahead", batch.index + 1)
        samples = []
        for (uid, prompt_ids, non_tensor), out in zip(meta, outputs):
            samples.append(
                Sample(
                    uid=uid,
                    prompt_ids=list(prompt_ids),
                    response_ids=out.token_ids,
                    rollout_log_probs=out.log_probs,
                    token_versions=out.token_versions,
                    non_tensor={**non_tensor, "start_version": start_version},
                )
            )
        return GeneratedBatch(index=batch.index, samples=samples, start_version=start_version)
