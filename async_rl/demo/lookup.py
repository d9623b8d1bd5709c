"""The lookup demo task: an agent that must call a tool, a varying number of times.

A table maps 4-digit keys either to a value (5 digits) or to another key. The prompt is a call for a
key (``" 3721"``); the model answers each turn with 5 tokens at most: a turn that starts with a
space (``" 5190"``) calls the lookup tool for that key, any other turn is the final answer. The tool's
reply (``"\\n 5190="`` for a key, ``"\\n88417="`` for a value, 5 spaces for no such key) is
environment text: tokenized on its own, masked out of the loss. A perfect agent repeats the latest
item it was given, so a key's chain of 1 to ``MAX_LOOKUPS`` lookups takes 2 to ``MAX_LOOKUPS + 1``
turns, and rollout lengths vary from sample to sample. The value is only in the tool's replies: a
model that never calls the tool scores 0.4 at most (``lookup_reward.compute_score``).

``LookupAgentLoop`` is a verl agent loop (``AgentLoopBase``), registered through verl's
``actor_rollout_ref.rollout.agent.agent_loop_config_path`` by the file ``prepare`` writes; it runs
under verl's own trainer and under the pipeline alike.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any
from uuid import uuid4

import numpy as np
import pandas as pd
from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput

from async_rl.demo.lookup_reward import ITEM_CHARS, TURN_SEPARATOR, is_call

DATA_SOURCE = "async_rl/lookup"
KEY_DIGITS, VALUE_DIGITS = ITEM_CHARS - 1, ITEM_CHARS
TURN_TOKENS = ITEM_CHARS  # a model turn: " " + a key, or a value
MAX_LOOKUPS = 3
# chain length -> keys in the table: half hold a value, the rest point 1 or 2 lookups further. A
# quarter of the 4-digit keys exist, so a wrongly copied key mostly finds nothing: the episode ends.
KEYS_BY_DEPTH = {1: 1250, 2: 750, 3: 500}
NOT_FOUND = " " * VALUE_DIGITS  # the tool's reply for a key it does not hold; the episode ends there
MAX_ASSISTANT_TURNS = MAX_LOOKUPS + 1
REPLY_TOKENS = 1 + VALUE_DIGITS + 1  # "\n" + item + "="
PROMPT_LENGTH = 1 + KEY_DIGITS + 1  # " " + key + the chat template's "="
RESPONSE_LENGTH = MAX_ASSISTANT_TURNS * TURN_TOKENS + (MAX_ASSISTANT_TURNS - 1) * REPLY_TOKENS


@dataclass(frozen=True)
class LookupTable:
    """key (4 digits) -> the tool's reply item: a value (5 digits) or a call for another key (" " + key)."""

    items: dict

    @classmethod
    @functools.lru_cache(maxsize=4)  # verl builds a loop per trajectory: one table per process and seed
    def build(cls, seed: int) -> "LookupTable":
        """The same table for the same seed, in every process (prepare, the agent loops, the tests)."""
        rng = np.random.default_rng(seed)
        keys = [f"{k:0{KEY_DIGITS}d}" for k in rng.permutation(10**KEY_DIGITS)]
        items, start, previous = {}, 0, []
        for depth, count in KEYS_BY_DEPTH.items():
            level = keys[start:start + count]
            start += len(level)
            for key in level:
                items[key] = (f"{int(rng.integers(10**VALUE_DIGITS)):0{VALUE_DIGITS}d}" if depth == 1
                              else " " + previous[int(rng.integers(len(previous)))])
            previous = level
        return cls(items)

    def reply(self, call: str) -> str:
        """The tool's reply item for a call turn (``" " + key``); ``NOT_FOUND`` for anything else."""
        return self.items.get(call[1:], NOT_FOUND)

    def perfect_turns(self, key: str) -> list:
        """What a perfect agent writes for a prompt's key (one the table holds): a call per lookup,
        then the value."""
        if key not in self.items:
            raise KeyError(f"the lookup table has no key {key!r}")
        turns = [" " + key]
        while is_call(turns[-1]):
            turns.append(self.reply(turns[-1]))
        return turns


def make_rows(table: LookupTable, keys: list, split: str) -> pd.DataFrame:
    """Rows in verl's RL data format; the ground truth is the perfect agent's turns joined by "|"."""
    return pd.DataFrame([
        {"data_source": DATA_SOURCE,
         "prompt": [{"role": "user", "content": " " + key}],
         "ability": "tool_use",
         "reward_model": {"style": "rule", "ground_truth": TURN_SEPARATOR.join(table.perfect_turns(key))},
         "extra_info": {"split": split, "index": index}}
        for index, key in enumerate(keys)])


def sample_keys(table: LookupTable, rng: np.random.Generator, train_size: int, val_size: int
                ) -> tuple[list, list]:
    """Prompt keys of the table: validation keys unique and never a training prompt."""
    keys = sorted(table.items)
    order = [keys[int(k)] for k in rng.permutation(len(keys))]
    val, pool = order[:val_size], order[val_size:]
    return [pool[int(i)] for i in rng.integers(len(pool), size=train_size)], val


class LookupAgentLoop(AgentLoopBase):
    """verl agent loop for the lookup task: model turns of ``TURN_TOKENS`` tokens at most, the tool
    answering each call, until an answer, a key the tool does not hold, ``multi_turn.max_assistant_turns``
    (default ``MAX_ASSISTANT_TURNS``) or the response budget. ``seed``: the table's (the YAML entry's key)."""

    def __init__(self, *args, seed: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.table = LookupTable.build(int(seed))
        limit = (self.rollout_config.get("multi_turn") or {}).get("max_assistant_turns")
        self.max_assistant_turns = int(limit or MAX_ASSISTANT_TURNS)

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        budget = int(self.rollout_config.response_length)
        prompt_ids = await self.ct_build_initial_tokens(list(kwargs["raw_prompt"]))
        request_id = uuid4().hex  # one trajectory: every turn on one server
        response, mask, log_probs = [], [], []
        turns, calls = 1, 0  # the user's prompt, then assistant and tool turns
        seconds = {"generate_sequences": 0.0, "tool_calls": 0.0}  # verl's AgentLoopMetrics
        versions = []  # the weight versions the server reports per turn (verl's trainer reads their range)
        for _ in range(self.max_assistant_turns):
            if len(response) >= budget:
                break
            started = time.perf_counter()
            out = await self.server_manager.generate(
                request_id=request_id, prompt_ids=prompt_ids + response,
                sampling_params={**sampling_params, "max_tokens": min(TURN_TOKENS, budget - len(response))})
            seconds["generate_sequences"] += time.perf_counter() - started
            versions += [v for v in (out.extra_fields.get("min_global_steps"), out.extra_fields.get("max_global_steps"))
                         if v is not None]
            response += out.token_ids
            mask += [1] * len(out.token_ids)
            log_probs += list(out.log_probs)
            turns += 1
            said = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
            if not is_call(said) or len(response) >= budget:
                break
            started = time.perf_counter()
            item = self.table.reply(said)
            seconds["tool_calls"] += time.perf_counter() - started
            reply = self.tokenizer.encode(f"\n{item}=", add_special_tokens=False)[:budget - len(response)]
            response += reply
            mask += [0] * len(reply)
            log_probs += [0.0] * len(reply)
            turns, calls = turns + 1, calls + 1
            if item == NOT_FOUND:
                break
        return AgentLoopOutput(prompt_ids=prompt_ids, response_ids=response, response_mask=mask,
                               response_logprobs=log_probs, num_turns=turns, metrics=seconds,
                               extra_fields={"turn_scores": [], "tool_rewards": [],
                                             "tool_call_counts": calls,  # verl's tool_call_counts/* metrics
                                             "min_global_steps": min(versions, default=None),
                                             "max_global_steps": max(versions, default=None)})
