"""reward stage: scores responses with verl's scoring, off the critical path.

The scoring function is verl's: the user's `reward.custom_reward_function` (loaded
with `verl.trainer.ppo.reward.get_custom_reward_fn`) or verl's
`default_compute_score` by data source. It runs in a worker thread under a timeout
(`reward.async_timeout_s`), so a hanging or raising reward function fails the run
with a message naming it instead of stalling the pipeline.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from state_machines.base import StateMachine
from state_machines.rollout import RolloutBatch


@dataclass
class ScoredBatch:
    """Per-sample scores of one step's batch (sequence-level, placed on the last token later).

    Stages between reward and actor_train may set `keep` to train on a subset of rows
    (actor_train still logs data metrics over every row) and add step `metrics`.
    """

    index: int
    scores: torch.Tensor  # (bs,) float32
    uids: np.ndarray  # (bs,) prompt-group id of each row (samples of one prompt share it)
    keep: Optional[torch.Tensor] = None  # (bs,) bool: rows to train on; None = all
    metrics: dict = field(default_factory=dict)  # merged into the step's logged metrics
    batch_ref: Any = None  # the scored DataProto, by reference (for stages that regroup rows)


class RewardFunctionError(RuntimeError):
    """The reward function raised or timed out."""


@dataclass(frozen=True)
class OverlongShaping:
    """DAPO's soft overlong punishment, read from verl's keys for its `dapo` reward manager:
    `reward.reward_manager.name=dapo`, `+reward.reward_kwargs.max_resp_len`,
    `+reward.reward_kwargs.overlong_buffer_cfg.{enable,len,penalty_factor}`."""

    max_resp_len: int
    buffer_len: int
    penalty_factor: float

    def penalty(self, length: int) -> float:
        """0 up to max_resp_len - buffer_len tokens, then linear down to -penalty_factor at max_resp_len."""
        exceed = length - (self.max_resp_len - self.buffer_len)
        return min(-exceed / self.buffer_len * self.penalty_factor, 0.0)


def overlong_shaping(config) -> Optional[OverlongShaping]:
    """The shaping verl's dapo reward manager would apply, or None; ValueError naming a bad key."""
    reward = config.get("reward") or {}
    manager = (reward.get("reward_manager") or {}).get("name")
    kwargs = reward.get("reward_kwargs") or {}
    buffer = kwargs.get("overlong_buffer_cfg")
    if manager != "dapo" or not buffer or not buffer.get("enable", False):
        return None
    key = "reward.reward_kwargs"
    max_len, buffer_len = kwargs.get("max_resp_len"), buffer.get("len")
    if not isinstance(buffer_len, int) or buffer_len <= 0:
        raise ValueError(f"{key}.overlong_buffer_cfg.len={buffer_len!r}: must be an integer > 0")
    if not isinstance(max_len, int) or max_len < buffer_len:
        raise ValueError(f"{key}.max_resp_len={max_len!r}: must be an integer >= overlong_buffer_cfg.len={buffer_len}")
    return OverlongShaping(max_len, buffer_len, float(buffer.get("penalty_factor", 1.0)))


def load_score_fn(config):
    """verl's scoring callable: custom function if configured, else `default_compute_score`."""
    from verl.trainer.ppo.reward import get_custom_reward_fn

    fn = get_custom_reward_fn(config)
    if fn is not None:
        return fn, str(config.reward.custom_reward_function.get("name", "compute_score"))
    from verl.utils.reward_score import default_compute_score

    return default_compute_score, "verl.utils.reward_score.default_compute_score"


def call_score_fn(score_fn, data_source, solution_str, ground_truth, extra_info) -> float:
    """One score from verl's reward-function signature (a float, or a dict with "score")."""
    result = score_fn(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth, extra_info=extra_info)
    return float(result["score"] if isinstance(result, dict) else result)


def score_batch(batch, tokenizer, score_fn, overlong: Optional[OverlongShaping] = None) -> torch.Tensor:
    """Decode each response (skipping special tokens, as verl's reward manager does) and score it,
    plus DAPO's overlong penalty when `overlong` is given."""
    responses = batch.batch["responses"]
    lengths = batch.batch["response_mask"].sum(-1).tolist()
    scores = []
    for i in range(len(batch)):
        text = tokenizer.decode(responses[i, : int(lengths[i])].tolist(), skip_special_tokens=True)
        scores.append(
            call_score_fn(
                score_fn,
                data_source=batch.non_tensor_batch["data_source"][i],
                solution_str=text,
                ground_truth=batch.non_tensor_batch["reward_model"][i]["ground_truth"],
                extra_info=batch.non_tensor_batch.get("extra_info", [None] * len(batch))[i],
            )
            + (overlong.penalty(int(lengths[i])) if overlong is not None else 0.0)
        )
    return torch.tensor(scores, dtype=torch.float32)


class RewardStage(StateMachine):
    """Scores each step's batch; the result goes to actor_train."""

    def __init__(self, config, tokenizer, timeout_s: float):
        super().__init__("reward")
        self.tokenizer = tokenizer
        self.score_fn, self.score_fn_name = load_score_fn(config)
        self.overlong = overlong_shaping(config)
        self.timeout_s = timeout_s

    async def get_input_data(self):
        return await self.next_from_inbox()

    async def process_data(self, data: RolloutBatch) -> ScoredBatch:
        batch = await data.get()
        try:
            scores = await asyncio.wait_for(
                asyncio.to_thread(score_batch, batch, self.tokenizer, self.score_fn, self.overlong), timeout=self.timeout_s
            )
        except asyncio.TimeoutError as exc:
            raise RewardFunctionError(
                f"reward function {self.score_fn_name} did not return within reward.async_timeout_s="
                f"{self.timeout_s:g} s for batch {data.index}"
            ) from exc
        except Exception as exc:
            raise RewardFunctionError(
                f"reward function {self.score_fn_name} raised {type(exc).__name__}: {exc} (batch {data.index})"
            ) from exc
        return ScoredBatch(
            index=data.index, scores=scores, uids=np.asarray(batch.non_tensor_batch["uid"]), batch_ref=data.batch_ref
        )

    async def send_output_data(self, data: ScoredBatch) -> bool:
        return await self.send_downstream(data)
