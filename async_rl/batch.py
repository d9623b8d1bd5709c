"""Builds verl `DataProto` batches from generated samples.

Layout is verl's: prompts left-padded to `max_prompt_length`, responses right-padded to
`max_response_length`, `input_ids = prompts ++ responses`, with `attention_mask`,
`position_ids` and `response_mask`. Rollout log-probs and per-token policy versions ride
along as `rollout_log_probs` and `token_versions` (version of the weights that produced
each response token; -1 on padding).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from verl import DataProto


@dataclass
class Sample:
    """One generated response to one prompt (one member of a GRPO group)."""

    uid: str  # prompt-group id: samples of one prompt share it
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_log_probs: list[float]
    token_versions: list[int]  # policy version that produced each response token
    non_tensor: dict[str, Any] = field(default_factory=dict)  # data_source, reward_model, ...
    score: float | None = None  # filled by the reward stage


def build_batch(samples: list[Sample], max_prompt_length: int, max_response_length: int, pad_token_id: int) -> DataProto:
    """Stack samples into a padded `DataProto` (verl's prompt/response layout)."""
    n = len(samples)
    prompts = torch.full((n, max_prompt_length), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((n, max_prompt_length), dtype=torch.long)
    responses = torch.full((n, max_response_length), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((n, max_response_length), dtype=torch.long)
    rollout_log_probs = torch.zeros((n, max_response_length), dtype=torch.float32)
    token_versions = torch.full((n, max_response_length), -1, dtype=torch.long)
    for i, s in enumerate(samples):
        p = s.prompt_ids[-max_prompt_length:]
        r = s.response_ids[:max_response_length]
        if p:
            prompts[i, -len(p) :] = torch.tensor(p)
            prompt_mask[i, -len(p) :] = 1
        if r:
            responses[i, : len(r)] = torch.tensor(r)
            response_mask[i, : len(r)] = 1
            rollout_log_probs[i, : len(r)] = torch.tensor(s.rollout_log_probs[: len(r)], dtype=torch.float32)
            token_versions[i, : len(r)] = torch.tensor(s.token_versions[: len(r)])
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    position_ids = torch.clamp(torch.cumsum(attention_mask, dim=1) - 1, min=0)
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "response_mask": response_mask,
        "rollout_log_probs": rollout_log_probs,
        "token_versions": token_versions,
    }
    keys = sorted({k for s in samples for k in s.non_tensor})
    non_tensors = {k: np.array([s.non_tensor.get(k) for s in samples], dtype=object) for k in keys}
    non_tensors["uid"] = np.array([s.uid for s in samples], dtype=object)
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)
