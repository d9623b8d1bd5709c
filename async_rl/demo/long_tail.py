"""The long-tail task: the copy-digits task with long-tailed response lengths, fixed per prompt.

RL on GPUs spends most of a step generating, and its response lengths have a long tail: most
responses are short, a few run to the length limit, and a synchronous step waits for the longest.
This task gives the copy-digits demo that shape by construction. Each prompt (4 digits, rewarded on
the first 4 characters of the response by the copy task's reward) carries a response length in its
row's ``extra_info["response_tokens"]``, drawn once by ``prepare`` from a seeded log-normal
(``LENGTH_LOG_MEAN``, ``LENGTH_LOG_SIGMA``) rounded and cut to [``MIN_RESPONSE_TOKENS``,
``LONG_RESPONSE_TOKENS``]: a mean of about 52 tokens (at most a quarter of the 256-token maximum) and
about 2% of the draws at the cap, the tail that a synchronous step waits for.

``LongTailAgentLoop`` (verl's ``SingleTurnAgentLoop``, registered under ``LONG_AGENT``) generates
exactly that many tokens: it asks the server for ``max_tokens`` = the row's length with
``ignore_eos`` (verl's vLLM server and this package's CPU backend honour both). Training and validation
rows both carry lengths, so the lengths are the same for every system that runs the task and do not
change as the policy learns (an untrained policy's lengths would otherwise drift with its EOS
probability): the systems are compared on one fixed workload shape.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd
from verl.experimental.agent_loop.agent_loop import AgentLoopOutput, register
from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop

from async_rl.demo.reward import NUM_DIGITS

DATA_SOURCE = "async_rl/long_tail"
LONG_AGENT = "long_tail"  # the task's agent loop, as registered (verl's `register` and AGENT_LOOPS_FILE)
RESPONSE_TOKENS_KEY = "response_tokens"  # the row's extra_info key holding its response length

LONG_RESPONSE_TOKENS = 256  # the cap: data.max_response_length of the task
MIN_RESPONSE_TOKENS = NUM_DIGITS  # the reward reads the first NUM_DIGITS characters
# log-normal of the lengths: median e^3.5 = 33 tokens; P(length >= 256) = 1 - Phi((ln 256 - 3.5) / 1) = 2.0%
LENGTH_LOG_MEAN = 3.5
LENGTH_LOG_SIGMA = 1.0
_LENGTH_STREAM = 256  # the draw's own random stream of a seed: the copy task's data stay as they were


def draw_response_tokens(seed: int, size: int) -> np.ndarray:
    """``size`` response lengths (ints in [MIN_RESPONSE_TOKENS, LONG_RESPONSE_TOKENS]), the same for the same
    seed: log-normal(LENGTH_LOG_MEAN, LENGTH_LOG_SIGMA), rounded, cut at both ends."""
    rng = np.random.default_rng([int(seed), _LENGTH_STREAM])
    lengths = np.rint(rng.lognormal(LENGTH_LOG_MEAN, LENGTH_LOG_SIGMA, size))
    return np.clip(lengths, MIN_RESPONSE_TOKENS, LONG_RESPONSE_TOKENS).astype(np.int64)


def with_lengths(rows: pd.DataFrame, lengths: np.ndarray) -> pd.DataFrame:
    """The copy task's rows (``task.make_rows``) as the long-tail task's: its data source, and each row's
    length in ``extra_info[RESPONSE_TOKENS_KEY]``."""
    if len(rows) != len(lengths):
        raise ValueError(f"{len(rows)} rows but {len(lengths)} lengths")
    rows = rows.copy()
    rows["data_source"] = DATA_SOURCE
    rows["extra_info"] = [{**info, RESPONSE_TOKENS_KEY: int(n)} for info, n in zip(rows["extra_info"], lengths)]
    return rows


def forced_length_params(sampling_params: Mapping[str, Any], extra_info: Mapping[str, Any] | None) -> dict:
    """The request's sampling params for a row: ``max_tokens`` = its ``extra_info[RESPONSE_TOKENS_KEY]`` and
    ``ignore_eos``, so the response is exactly that long. Raises KeyError for a row without a length."""
    if not extra_info or RESPONSE_TOKENS_KEY not in extra_info:
        raise KeyError(f"the long-tail task's rows carry extra_info[{RESPONSE_TOKENS_KEY!r}] (async_rl.demo.prepare "
                       f"writes them); this row has {dict(extra_info or {})}")
    return {**sampling_params, "max_tokens": int(extra_info[RESPONSE_TOKENS_KEY]), "ignore_eos": True}


@register(LONG_AGENT)
class LongTailAgentLoop(SingleTurnAgentLoop):
    """verl's single-turn agent loop, each response exactly as long as its row says (``forced_length_params``)."""

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        return await super().run(forced_length_params(sampling_params, kwargs.get("extra_info")), **kwargs)
