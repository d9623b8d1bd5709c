"""reward stage: scores each step's responses with verl's reward function, off the critical path.

The scoring is async_rl/core/scoring.py's (verl's reward-function signature, DAPO's overlong
shaping); the stage runs it in a worker thread under `reward.async_timeout_s`. What a raising or
hanging reward function does is `reward.on_error`: `stop` (default) fails the run naming the
function and the batch; `zero` scores that sample 0, counts it (`async/faults/reward_errors`)
and goes on (the timeout then applies to each sample; a hung call's thread is left behind).
ReMax: the greedy sample of each prompt is scored the same way, as its rows' `baselines`.
With a reward model (`reward_router` set: `reward.reward_model.enable=True`), a reward manager other
than naive / dapo or `reward.sandbox_fusion.url` every row is scored by verl's own reward loop (through
the reward model's router where there is one: async_rl/core/reward_loop_scoring.py), under the same
timeout and `reward.on_error`.
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import torch

from async_rl.core.messages import RolloutBatch, ScoredBatch, resolve
from async_rl.core.reward_loop_scoring import RewardLoopScorer, rows_of, uses_reward_loop
from async_rl.core.scoring import (
    RewardFunctionError,
    decode_responses,
    load_score_fn,
    overlong_shaping,
    score_batch,
    score_each_zeroing_failures,
)
from state_machines.base import StateMachine

logger = logging.getLogger(__name__)

REMAX_BASELINE_METRIC = "async/remax/baseline_score/mean"  # mean score of the step's greedy samples


class RewardStage(StateMachine):
    """Scores each step's batch; the result goes to actor_train."""

    def __init__(self, *, config, tokenizer, timeout_s: float, on_error: str = "stop", reward_router: str | None = None):
        super().__init__("reward")
        self.tokenizer = tokenizer
        self.config, self.reward_router = config, reward_router  # "ip:port" of the reward model's router
        self.reward_loop = reward_router is not None or uses_reward_loop(config)  # verl's RewardLoopWorker scores
        self.reward_model: RewardLoopScorer | None = None  # built on first use, in the stage's event loop
        self.score_fn, self.score_fn_name = load_score_fn(config)
        self.overlong = overlong_shaping(config)
        self.timeout_s = timeout_s
        self.on_error = on_error  # "stop" or "zero" (async_rl.core.config.REWARD_ON_ERROR, validated there)

    async def process_data(self, data: RolloutBatch) -> ScoredBatch:
        batch = await data.get()
        uids = np.asarray(batch.non_tensor_batch["uid"])
        scores, failures = await self._score(batch, data.index)
        baselines, metrics = None, {}
        if data.baseline_ref is not None:  # ReMax: each prompt's greedy sample, scored, is its rows' baseline
            greedy = await resolve(data.baseline_ref)
            greedy_scores, greedy_failures = await self._score(greedy, data.index)
            failures += greedy_failures
            by_uid = dict(zip(greedy.non_tensor_batch["uid"].tolist(), greedy_scores.tolist()))
            baselines = torch.tensor([by_uid[uid] for uid in uids.tolist()], dtype=torch.float32)
            metrics[REMAX_BASELINE_METRIC] = float(greedy_scores.mean())
        return ScoredBatch(
            index=data.index, scores=scores, uids=uids, batch_ref=data.batch_ref, baselines=baselines,
            metrics={"async/faults/reward_errors": float(len(failures)), **metrics},
        )

    async def _score(self, batch, index: int) -> tuple[torch.Tensor, list]:
        """(score of each row, the rows whose scoring failed and why) under `reward.on_error`."""
        if self.reward_loop:
            return await self._score_with_reward_model(batch, index)
        if self.on_error != "zero":
            return await self._score_or_stop(batch, index), []
        responses = await asyncio.to_thread(decode_responses, batch, self.tokenizer)
        scores, failures = await score_each_zeroing_failures(responses, self.score_fn, self.overlong, self.timeout_s)
        if failures:
            row, cause = failures[0]
            logger.warning("reward function %s failed on %d of %d samples of batch %d (scored 0; first: row %d, "
                           "%s)", self.score_fn_name, len(failures), len(responses), index, row, cause)
        return scores, failures

    async def _score_with_reward_model(self, batch, index: int) -> tuple[torch.Tensor, list]:
        if self.reward_model is None:  # here: verl's reward managers keep the running loop for their calls
            self.reward_model = RewardLoopScorer(self.config, self.reward_router)
        scores, failures = await self.reward_model.score(rows_of(batch), self.timeout_s)
        if failures:
            row, cause = failures[0]
            if self.on_error != "zero":
                raise RewardFunctionError(f"{self.reward_model.what} failed on row {row} of batch {index}: {cause} "
                                          "(reward.on_error=zero scores such samples 0 instead)")
            logger.warning("%s failed on %d of %d samples of batch %d (scored 0; first: row %d, %s)",
                           self.reward_model.what, len(failures), len(batch), index, row, cause)
        return scores, failures

    async def _score_or_stop(self, batch, index: int) -> torch.Tensor:
        try:
            return await asyncio.wait_for(
                asyncio.to_thread(score_batch, batch, self.tokenizer, self.score_fn, self.overlong), timeout=self.timeout_s
            )
        except asyncio.TimeoutError as exc:
            raise RewardFunctionError(
                f"reward function {self.score_fn_name} did not return within reward.async_timeout_s="
                f"{self.timeout_s:g} s for batch {index} (reward.on_error=zero scores such samples 0 instead)"
            ) from exc
        except Exception as exc:
            raise RewardFunctionError(
                f"reward function {self.score_fn_name} raised {type(exc).__name__}: {exc} (batch {index}; "
                "reward.on_error=zero scores such samples 0 instead)"
            ) from exc
