"""generate stage: admits prompt batches under the staleness bound and runs verl's agent loop
of every sample.

Each sample is one trajectory of the agent loop verl would run for it (single-turn, tool calls, a
user's own loop: async_rl/rollout/agent_loops.py), whose model calls go to the rollout servers only
through verl's server interface (`generate` on the server handle of a `RolloutReplica`), so the CPU
backend, sglang and vllm are interchangeable. Trajectories are spread round-robin over the
servers, each keeping its turns on one (or as the user's load balancer of `rollout.router_config_path`
chooses: async_rl/rollout/routing.py); up to `generate_ahead_steps` batches are in flight, each
admitted only when AReaL's rule (`async_rl.core.staleness.StalenessGate`) allows it against the policy
clock's versions (`async_rl.core.policy_clock`).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from async_rl.core.fault_points import hold_at
from async_rl.core.messages import GeneratedBatch, PromptBatch, Sample
from async_rl.core.policy_clock import ClockRef
from async_rl.rollout.agent_loops import (
    PipelineAgentLoopWorker,
    PipelineLLMClient,
    prompt_rows,
    samples_from_agent_output,
)
from async_rl.rollout.rollout_dumps import RolloutDumps
from async_rl.rollout.routing import UserRouter, server_ids
from async_rl.rollout.supervisor import ReplicaSupervisor
from async_rl.rollout.teachers import teacher_clients
from async_rl.rollout.verl_replicas import announce_to_prometheus
from state_machines.base import StateMachine


class GenerateStage(StateMachine):
    """Runs `n` agent-loop trajectories per prompt on the rollout servers, within the staleness bound."""

    def __init__(
        self, *, servers, config, clock: ClockRef, request_timeout_s: float = 600.0, tool_timeout_s: float = 120.0,
        tool_pool_size: int | None = None, replicas=None, max_restarts: int = 0, relaunch=None, weight_source=None,
        teacher_routers: dict | None = None,
    ):
        """`config`: the run's verl config (its rollout and agent-loop keys). `clock`: the policy clock
        (async_rl/core/policy_clock.py), whose gate admits each prompt batch against the served version
        and holds `gate.batches_ahead` batches at once. `request_timeout_s`, `tool_timeout_s` (s): bound one
        model request, one tool call of an agent loop. `tool_pool_size`: each tool's environments in use at
        once (None: no limit). `replicas` (verl RolloutReplica objects behind `servers`), `relaunch` (the
        backend's `async relaunch(replica, attempt) -> server handle`, async_rl/api/rollout.py) and
        `max_restarts`: a lost server is restarted up to that many times (async_rl/rollout/supervisor.py);
        the new one gets its weights from `weight_source` (the param_update stage), and a server a weight
        sync finds lost reaches this stage through the clock. `teacher_routers`: verl's load balancer of each
        distillation teacher, by routing key (async_rl/rollout/teachers.py); each trajectory is scored by its
        teacher, each request bounded by `request_timeout_s`."""
        super().__init__("generate", inbox_size=clock.gate.batches_ahead, max_inflight=clock.gate.batches_ahead)
        if not servers:
            raise ValueError("generate stage needs at least one rollout server")
        self.replicas = list(replicas) if replicas is not None else None
        self._replica_relaunch = relaunch
        self._weight_source = weight_source
        restartable = bool(max_restarts) and self.replicas is not None and relaunch is not None
        self.servers = ReplicaSupervisor(
            list(servers), max_restarts if restartable else 0,
            relaunch=self._relaunch if restartable else None,
            feed_weights=self._feed_weights if restartable else None, trace=self.trace,
        )
        self.config = config
        self.n = int(config.actor_rollout_ref.rollout.n)
        self.greedy_baselines = wants_greedy_baselines(config)
        self._agent_loops = None  # verl's AgentLoopWorker, built at first use (loads the tokenizer and tools)
        self.rollout_dumps = RolloutDumps.from_config(config)  # verl's skip.rollout; None when off
        self.gate = clock.gate
        self.policy_clock = clock.view(on_lost=self._server_lost)
        self.request_timeout_s, self.tool_timeout_s = request_timeout_s, tool_timeout_s
        self.tool_pool_size = tool_pool_size
        self.teacher_routers = dict(teacher_routers or {})
        # rollout.router_config_path's load balancer, built with the agent loops; an actor of this stage's process
        self.router: UserRouter | None = None

    # ---- rollout servers: restarts (async_rl/rollout/supervisor.py) --------------------------
    async def _relaunch(self, index: int, attempt: int):
        handle = await self._replica_relaunch(self.replicas[index], attempt)
        if self.router is not None:
            await self.router.replace(index, server_ids(self.replicas, len(self.replicas))[index], handle)
        await asyncio.to_thread(announce_to_prometheus, self.config, self.replicas)  # its new address
        return handle

    async def _feed_weights(self, index: int, handle) -> int:
        if self._weight_source is None:
            raise RuntimeError("no weight source (the param_update stage) to load the weights into the new server")
        replica = self.replicas[index]  # its actors now: verl's replicas' new workers load the weights
        actors = (list(replica.workers), list(replica.servers))
        return await self._weight_source.replace_rollout_server.remote(index, handle, actors)

    def _server_lost(self, index: int, handle, cause: str, hung: bool = False) -> None:
        """A weight sync found the server gone (or, `hung`, silent); reported through the clock."""
        try:
            self.servers.lost(index, handle, cause, hung=hung)
        except Exception:  # noqa: BLE001 - the failure is kept; the next request raises it in this stage
            pass

    async def server_handles(self) -> list:
        """The current server of every replica, once none is restarting (the weight digests read them)."""
        return await self.servers.all_ready()

    def agent_loops(self):
        """verl's agent-loop worker on this stage's servers (async_rl/rollout/agent_loops.py)."""
        if self._agent_loops is None:
            path = self.config.actor_rollout_ref.rollout.get("router_config_path")
            if path:
                self.router = UserRouter.start(path, self.servers.handles, self.replicas, self.request_timeout_s)
            client = PipelineLLMClient(self.config, self.servers, self.request_timeout_s,
                                       lambda: self.policy_clock.served_version, router=self.router)
            teachers = teacher_clients(self.config, self.teacher_routers, self.request_timeout_s)
            self._agent_loops = PipelineAgentLoopWorker(self.config, client, self.tool_timeout_s, self.tool_pool_size,
                                                        teachers)
        return self._agent_loops

    async def run_agent_loops(self, rows: list[dict], n: int, start_version: int | None = None,
                              validate: bool = False, greedy_baselines: bool = False,
                              step: int | None = None) -> list[Sample]:
        """`n` trajectories of each row (a dataset row's non-tensor fields: `raw_prompt`, `agent_name`, ...),
        through the same supervised path as training; validation uses it with `validate=True` (verl's
        `val_kwargs` sampling). `start_version`: the version served when the batch was admitted (None:
        the version served now). `greedy_baselines` (ReMax): then one greedy trajectory of each row, last.
        `step`: the training step the batch is for (validation: the step validated after), where verl's
        `skip.rollout` dumps or replays it, and the step its agent loops and rollout trace see."""
        await self.policy_clock.follow()
        if start_version is None:
            start_version = self.policy_clock.served_version
        dumps = self.rollout_dumps if step is not None and not validate else None
        output = None
        if dumps is not None:
            with self.trace.span("generate", "skip.rollout's dump read", step=step):
                output = await asyncio.to_thread(dumps.replayed, step)
        if output is None:
            proto = prompt_rows(rows, [uuid.uuid4().hex for _ in rows], n,
                                start_version if step is None else step, greedy_baselines)
            proto.meta_info["validate"] = validate
            output = await self.agent_loops().generate_sequences(proto)
            if dumps is not None:
                await asyncio.to_thread(dumps.dump, step, output)
        return samples_from_agent_output(output, start_version)

    def fault_counts(self) -> dict[str, float]:
        """Cumulative `async/faults/replica_restarts` and `async/faults/requests_resubmitted`."""
        return self.servers.counts()

    async def get_input_data(self):
        item = await self.next_from_inbox()
        if isinstance(item, PromptBatch):
            # Admission happens here, in input order, so batch j never overtakes j-1.
            await self.policy_clock.follow()
            with self.trace.span("wait", "admission (staleness bound)", index=item.index,
                                 served_version=self.policy_clock.served_version):
                versions = self.policy_clock
                await versions.wait_until(lambda: self.gate.admits(item.index, versions.served_version,
                                                                   versions.steps_formed))
        return item

    def trace_args(self, data: Any) -> dict:
        """The batch's index and the version served when its generation began."""
        return {**super().trace_args(data), "version": self.policy_clock.served_version}

    async def process_data(self, batch: PromptBatch) -> GeneratedBatch:
        start_version = self.policy_clock.served_version
        samples = await self.run_agent_loops(batch.non_tensor, self.n, start_version,
                                             greedy_baselines=self.greedy_baselines, step=batch.index + 1)
        if batch.index > start_version:  # started ahead of the trainer (whatever it reached since)
            hold_at("generate_ahead", batch.index + 1)
        trained = len(batch.non_tensor) * self.n
        return GeneratedBatch(index=batch.index, samples=samples[:trained], start_version=start_version,
                              baselines=samples[trained:])


def wants_greedy_baselines(config) -> bool:
    """ReMax (`algorithm.adv_estimator=remax`): each prompt's greedy sample, scored, is its samples' baseline."""
    from verl.trainer.ppo.core_algos import AdvantageEstimator

    return config.algorithm.adv_estimator == AdvantageEstimator.REMAX
