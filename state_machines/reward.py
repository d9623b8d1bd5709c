"""reward stage: scores responses with verl's scoring, off the critical path.

The scoring function is verl's: the user's `reward.custom_reward_function` (loaded
with `verl.trainer.ppo.reward.get_custom_reward_fn`) or verl's
`default_compute_score` by data source. It runs in a worker thread under a timeout
(`reward.async_timeout_s`). What a raising or hanging reward function does is
`reward.on_error`: `stop` (default) fails the run with a message naming the function and
the batch; `zero` scores that sample 0, counts it (`async/faults/reward_errors`) and goes
on; the timeout then applies to each sample, and a hung call's thread is left behind.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from state_machines.base import StateMachine
from state_machines.rollout import RolloutBatch

logger = logging.getLogger(__name__)



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


@dataclass(frozen=True)
class ResponseToScore:
    """One decoded response with what verl's reward-function signature takes."""

    data_source: Any
    solution_str: str
    ground_truth: Any
    extra_info: Any
    length: int  # response tokens


def decode_responses(batch, tokenizer) -> list[ResponseToScore]:
    """Decode each response, skipping special tokens, as verl's reward manager does."""
    responses = batch.batch["responses"]
    lengths = batch.batch["response_mask"].sum(-1).tolist()
    extra = batch.non_tensor_batch.get("extra_info", [None] * len(batch))
    return [
        ResponseToScore(
            data_source=batch.non_tensor_batch["data_source"][i],
            solution_str=tokenizer.decode(responses[i, : int(lengths[i])].tolist(), skip_special_tokens=True),
            ground_truth=batch.non_tensor_batch["reward_model"][i]["ground_truth"],
            extra_info=extra[i],
            length=int(lengths[i]),
        )
        for i in range(len(batch))
    ]


def score_response(score_fn, response: ResponseToScore, overlong: Optional[OverlongShaping] = None) -> float:
    """The reward function's score, plus DAPO's overlong penalty when `overlong` is given."""
    score = call_score_fn(score_fn, data_source=response.data_source, solution_str=response.solution_str,
                          ground_truth=response.ground_truth, extra_info=response.extra_info)
    return score + (overlong.penalty(response.length) if overlong is not None else 0.0)


def score_batch(batch, tokenizer, score_fn, overlong: Optional[OverlongShaping] = None) -> torch.Tensor:
    """Every response's score (see `score_response`), in row order."""
    return torch.tensor([score_response(score_fn, r, overlong) for r in decode_responses(batch, tokenizer)],
                        dtype=torch.float32)


async def score_each_zeroing_failures(responses: list[ResponseToScore], score_fn, overlong, timeout_s: float
                                      ) -> tuple[torch.Tensor, list[tuple[int, str]]]:
    """Scores in row order, a response whose call raises or takes over `timeout_s` (s) scored 0.

    The calls run one after another in a daemon thread; when one hangs, the thread is left
    behind and a new one goes on from the next response. Returns the scores and the
    (row, cause) of every failed call.
    """
    loop = asyncio.get_running_loop()
    results: asyncio.Queue = asyncio.Queue()

    def work(start: int, run: int) -> None:
        for i in range(start, len(responses)):
            try:
                value, cause = score_response(score_fn, responses[i], overlong), None
            except Exception as exc:  # noqa: BLE001 - the user's function may raise anything
                value, cause = 0.0, f"{type(exc).__name__}: {exc}"
            loop.call_soon_threadsafe(results.put_nowait, (run, i, value, cause))

    def start(at: int, run: int) -> None:
        threading.Thread(target=work, args=(at, run), daemon=True, name=f"reward-from-{at}").start()

    scores, failures, run, next_row = [0.0] * len(responses), [], 0, 0
    if responses:
        start(0, run)
    while next_row < len(responses):
        try:
            got_run, row, value, cause = await asyncio.wait_for(results.get(), timeout=timeout_s)
        except asyncio.TimeoutError:
            failures.append((next_row, f"no score within reward.async_timeout_s={timeout_s:g} s"))
            next_row, run = next_row + 1, run + 1
            if next_row < len(responses):
                start(next_row, run)
            continue
        if got_run != run:  # a thread given up on finished late
            continue
        scores[row], next_row = value, row + 1
        if cause is not None:
            failures.append((row, cause))
    return torch.tensor(scores, dtype=torch.float32), failures


class RewardStage(StateMachine):
    """Scores each step's batch; the result goes to actor_train."""

    def __init__(self, config, tokenizer, timeout_s: float, on_error: str = "stop"):
        super().__init__("reward")
        self.tokenizer = tokenizer
        self.score_fn, self.score_fn_name = load_score_fn(config)
        self.overlong = overlong_shaping(config)
        self.timeout_s = timeout_s
        self.on_error = on_error  # "stop" or "zero" (async_rl.config.REWARD_ON_ERROR, validated there)

    async def process_data(self, data: RolloutBatch) -> ScoredBatch:
        batch = await data.get()
        if self.on_error == "zero":
            responses = await asyncio.to_thread(decode_responses, batch, self.tokenizer)
            scores, failures = await score_each_zeroing_failures(responses, self.score_fn, self.overlong,
                                                                 self.timeout_s)
            if failures:
                row, cause = failures[0]
                logger.warning("reward function %s failed on %d of %d samples of batch %d (scored 0; first: row %d, "
                               "%s)", self.score_fn_name, len(failures), len(responses), data.index, row, cause)
        else:
            scores, failures = await self._score_or_stop(batch, data.index), []
        return ScoredBatch(
            index=data.index, scores=scores, uids=np.asarray(batch.non_tensor_batch["uid"]), batch_ref=data.batch_ref,
            metrics={"async/faults/reward_errors": float(len(failures))},
        )

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
