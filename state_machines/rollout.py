"""rollout stage: turns generated samples into one verl `DataProto` per step and fans out (ReMax: a
second one of the greedy baseline samples, for the reward stage).

The batch is put into Ray's object store once; reward, logp and ref_logp each get a
reference to it (`RolloutBatch`), so it is serialized once, not three times.
"""

from __future__ import annotations

import ray

from async_rl.core.messages import GeneratedBatch, RolloutBatch, build_batch
from state_machines.base import StateMachine


class RolloutStage(StateMachine):
    """Pads and stacks a step's samples (verl layout) and sends the batch to every consumer."""

    def __init__(self, *, max_prompt_length: int, max_response_length: int, pad_token_id: int):
        super().__init__("rollout")
        self.max_prompt_length = max_prompt_length
        self.max_response_length = max_response_length
        self.pad_token_id = pad_token_id

    async def process_data(self, data: GeneratedBatch) -> RolloutBatch:
        refs = []
        for samples in (data.samples, data.baselines):
            batch = build_batch(samples, self.max_prompt_length, self.max_response_length, self.pad_token_id) \
                if samples else None
            refs.append(ray.put(batch) if ray.is_initialized() and batch is not None else batch)
        return RolloutBatch(index=data.index, batch_ref=refs[0], start_version=data.start_version, baseline_ref=refs[1])
