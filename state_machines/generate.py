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
    """verl's rollout sampling keys -> server sampling params (vllm/sglang names)."""
    if validate:
        val = rollout_cfg.val_kwargs
        greedy = not val.do_sample
        return {
            "temperature": 0.0 if greedy else float(val.temperature),
            "top_p": 1.0 if greedy else float(val.top_p),
            "top_k": -1 if greedy else int(val.top_k),
            "max_tokens": int(rollout_cfg.response_length),
            "logprobs": True,
        }
    return {
        "temperature": float(rollout_cfg.temperature),
        "top_p": float(rollout_cfg.top_p),
        "top_k": int(rollout_cfg.top_k),
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
    server, prompt_ids: list[int], sampling_params: dict, timeout_s: float, served_version: int, max_segments: int = 64
) -> Response:
    """Generate, resubmitting prompt + tokens so far whenever the server aborts the request
    (verl's GPU servers abort in-flight requests around a weight load). Tokens, behaviour
    log-probs and the version of each token are kept; the resubmission gets the remaining
    token budget and its KV cache is recomputed under the new weights."""
    budget = int(sampling_params["max_tokens"])
    tokens: list[int] = []
    log_probs: list[float] = []
    versions: list[int] = []
    for segment in range(1, max_segments + 1):
        params = {**sampling_params, "max_tokens": budget - len(tokens)}
        out = await generate_one(server, list(prompt_ids) + tokens, params, timeout_s)
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
        steps_formed: int = 0,
    ):
        """`dynamic_sampling`: batch indices are not training steps; a batch is admitted while the next
        training batch to form (`set_steps_formed`; `steps_formed` at start) is within the staleness bound."""
        super().__init__("generate", inbox_size=max_staleness + 1, max_inflight=max_staleness + 1)
        if not servers:
            raise ValueError("generate stage needs at least one rollout server")
        self.servers = list(servers)
        self.n = int(rollout_cfg.n)
        self.sampling_params = sampling_params_from_config(rollout_cfg)
        self.staleness = StalenessController(max_staleness)
        self.request_timeout_s = request_timeout_s
        self._next_server = 0
        self.dynamic_sampling = dynamic_sampling
        self.steps_formed = steps_formed

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

    def _pick_server(self):
        server = self.servers[self._next_server % len(self.servers)]
        self._next_server += 1
        return server

    async def process_data(self, batch: PromptBatch) -> GeneratedBatch:
        start_version = self.staleness.served_version
        jobs, meta = [], []
        for prompt_ids, non_tensor in zip(batch.prompt_ids, batch.non_tensor):
            uid = uuid.uuid4().hex
            for _ in range(self.n):
                jobs.append(generate_resumable(self._pick_server(), prompt_ids, self.sampling_params,
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

    async def send_output_data(self, data: GeneratedBatch) -> bool:
        return await self.send_downstream(data)
