"""generate stage: admits prompt batches under the staleness bound and samples responses.

Talks to rollout servers only through verl's server interface (`generate` on the
server handle of a `RolloutReplica`), so the CPU backend, sglang and vllm are
interchangeable. Each batch's n samples per prompt are spread round-robin over the
servers; up to `generate_ahead_steps` batches are in flight, each admitted only when
AReaL's rule allows it (`async_rl.staleness`).
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

from async_rl.batch import Sample
from async_rl.fault_points import hold_at
from async_rl.replica_supervisor import REQUEST_TIMEOUT_KEY, ReplicaSupervisor, is_lost_server_error
from async_rl.staleness import StalenessController
from state_machines.base import StateMachine
from state_machines.dataloader import PromptBatch


@dataclass
class GeneratedBatch:
    """All samples of one step: `n` responses for each prompt of the PromptBatch."""

    index: int
    samples: list[Sample]
    start_version: int  # version served when the batch was admitted


def sampling_params_from_config(rollout_cfg, validate: bool = False) -> dict:
    """verl's rollout sampling keys (`val_kwargs` for validation, greedy unless it samples) -> server
    sampling params (vllm/sglang names)."""
    keys = rollout_cfg.val_kwargs if validate else rollout_cfg
    greedy = validate and not keys.do_sample
    return {
        "temperature": 0.0 if greedy else float(keys.temperature),
        "top_p": 1.0 if greedy else float(keys.top_p),
        "top_k": -1 if greedy else int(keys.top_k),
        "max_tokens": int(rollout_cfg.response_length),
        "logprobs": True,
    }


async def generate_one(server, prompt_ids: list[int], sampling_params: dict, timeout_s: float):
    """One request through verl's server interface; returns its TokenOutput."""
    request_id = uuid.uuid4().hex
    ref = server.generate.remote(prompt_ids=prompt_ids, sampling_params=dict(sampling_params), request_id=request_id)
    return await asyncio.wait_for(ref, timeout=timeout_s)


@dataclass
class Response:
    """A response assembled from one or more segments (a segment ends when a weight load aborts it)."""

    token_ids: list[int]
    log_probs: list[float]
    token_versions: list[int]
    segments: int


async def generate_resumable(
    servers: ReplicaSupervisor, preferred: int, prompt_ids: list[int], sampling_params: dict, timeout_s: float,
    served_version: int, max_segments: int = 64,
) -> Response:
    """Generate on replica `preferred` (or a surviving one), resubmitting prompt + tokens so far
    whenever a segment ends early: the server aborted the request (verl's GPU servers abort
    in-flight requests around a weight load) or the server was lost (its process gone, or no
    answer within `timeout_s`, s; `servers` restarts it and the request goes to a survivor).
    Tokens, behaviour log-probs and the version of each token are kept; the resubmission gets
    the remaining token budget and its KV cache is recomputed under the served weights."""
    budget = int(sampling_params["max_tokens"])
    tokens: list[int] = []
    log_probs: list[float] = []
    versions: list[int] = []
    segment = 0
    while segment < max_segments:
        index, server = await servers.acquire(preferred)
        params = {**sampling_params, "max_tokens": budget - len(tokens)}
        try:
            out = await generate_one(server, list(prompt_ids) + tokens, params, timeout_s)
        except Exception as exc:  # noqa: BLE001 - only a lost server is survived
            hung = isinstance(exc, asyncio.TimeoutError)
            if not hung and not is_lost_server_error(exc):
                raise
            cause = (f"no answer to a request within {timeout_s:g} s ({REQUEST_TIMEOUT_KEY})" if hung
                     else f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            servers.lost(index, server, cause, hung=hung)
            servers.requests_resubmitted += 1
            continue
        segment += 1
        fields = out.extra_fields or {}
        tokens += list(out.token_ids)
        log_probs += list(out.log_probs or [0.0] * len(out.token_ids))
        version = fields.get("global_steps", served_version)
        versions += list(fields.get("token_versions") or [version if version is not None else served_version]
                         * len(out.token_ids))
        if out.stop_reason != "aborted" or len(tokens) >= budget:
            return Response(tokens, log_probs, versions, segment)
    raise RuntimeError(f"request aborted {max_segments} times in a row; the rollout server keeps aborting it")


class GenerateStage(StateMachine):
    """Samples `n` responses per prompt on the rollout servers, within the staleness bound."""

    def __init__(
        self, servers, rollout_cfg, max_staleness: int, request_timeout_s: float = 600.0, dynamic_sampling: bool = False,
        steps_formed: int = 0, replicas=None, max_restarts: int = 0,
    ):
        """`dynamic_sampling`: batch indices are not training steps; a batch is admitted while the next
        training batch to form (`set_steps_formed`; `steps_formed` at start) is within the staleness bound.
        `replicas` (verl RolloutReplica objects behind `servers`, with `relaunch`) and `max_restarts`:
        a lost server is restarted up to that many times (async_rl/replica_supervisor.py); the new one
        gets its weights from the param_update stage (`attach_weight_source`)."""
        super().__init__("generate", inbox_size=max_staleness + 1, max_inflight=max_staleness + 1)
        if not servers:
            raise ValueError("generate stage needs at least one rollout server")
        self.replicas = list(replicas) if replicas is not None else None
        self._weight_source = None
        restartable = bool(max_restarts) and self.replicas is not None
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

    # ---- rollout servers: restarts (async_rl/replica_supervisor.py) --------------------------
    def attach_weight_source(self, param_update) -> None:
        """The param_update stage, which loads the newest weights into a restarted server."""
        self._weight_source = param_update

    async def _relaunch(self, index: int, attempt: int):
        replica = self.replicas[index]
        if hasattr(replica, "relaunch"):  # the CPU backend's replica
            return await replica.relaunch(attempt)
        from async_rl.rollout_backends import relaunch_on_devices  # verl's GPU replicas

        return await relaunch_on_devices(replica, attempt)

    async def _feed_weights(self, index: int, handle) -> int:
        if self._weight_source is None:
            raise RuntimeError("no param_update stage attached to load the weights into the new server")
        replica = self.replicas[index]  # verl's GPU replica: its new workers load the weights
        actors = None if hasattr(replica, "relaunch") else (list(replica.workers), list(replica.servers))
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
