"""Reward scoring: verl's reward-function signature, DAPO's overlong shaping, and a guard for
functions that raise or hang. Used by the reward stage and by validation.

The scoring function is verl's: the user's `reward.custom_reward_function` (loaded with
`verl.trainer.ppo.reward.get_custom_reward_fn`) or verl's `default_compute_score` by data source.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from async_rl.core.messages import response_lengths


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
    lengths = response_lengths(batch).tolist()
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
    behind (it calls the function no more once that call returns) and a new one goes on from
    the next response. Returns the scores and the
    (row, cause) of every failed call.
    """
    loop = asyncio.get_running_loop()
    results: asyncio.Queue = asyncio.Queue()
    current = [0]  # the run whose results count; a thread given up on stops at its next row

    def work(start: int, run: int) -> None:
        for i in range(start, len(responses)):
            if current[0] != run:
                return
            try:
                value, cause = score_response(score_fn, responses[i], overlong), None
            except Exception as exc:  # noqa: BLE001 - the user's function may raise anything
                value, cause = 0.0, f"{type(exc).__name__}: {exc}"
            try:
                loop.call_soon_threadsafe(results.put_nowait, (run, i, value, cause))
            except RuntimeError:  # the batch's loop has closed: nobody waits for this score
                return

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
            current[0] = run
            if next_row < len(responses):
                start(next_row, run)
            continue
        if got_run != run:  # a thread given up on finished late
            continue
        scores[row], next_row = value, row + 1
        if cause is not None:
            failures.append((row, cause))
    return torch.tensor(scores, dtype=torch.float32), failures


def groups_with_distinct_rewards(uids: np.ndarray, scores: torch.Tensor, min_std: float = 0.0) -> torch.Tensor:
    """(bs,) bool: True for rows whose prompt group's rewards have std > `min_std`, or that are
    alone in their group (verl's `filter_groups` rule: a one-sample group is kept)."""
    keep = torch.zeros(len(uids), dtype=torch.bool)
    for uid in dict.fromkeys(uids.tolist()):
        rows = torch.from_numpy(uids == uid)
        group = scores[rows]
        keep[rows] = len(group) == 1 or float(group.std()) > min_std
    return keep
