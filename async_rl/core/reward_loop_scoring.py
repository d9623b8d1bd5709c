"""Scoring with a reward model: verl 0.9.1's own reward loop (`RewardLoopWorker`) over the run's
reward-model router, for the reward stage and validation when `reward.reward_model.enable=True`.

verl's rules, unchanged: with `reward.custom_reward_function.path` the user's function scores and is
given `reward_router_address` and `reward_model_tokenizer` (how verl combines a rule reward with a
reward model, or runs a generative one); without, the discriminative reward model scores the
response under its chat template. Each row is scored on its own, under a deadline (s), so one
that hangs or raises is named (`reward.on_error`).
"""

from __future__ import annotations

import asyncio
from typing import Optional

import torch

from async_rl.core.messages import object_column
from verl_patches.cpu_reward_model import patch_disrm_on_cpu


def one_row(prompt_ids: list[int], response_ids: list[int], non_tensor: dict):
    """A one-row DataProto in verl's layout (`prompts`, `responses`, `attention_mask`; the row's
    non-tensor fields), as verl's reward loop reads it."""
    from verl import DataProto

    prompts, responses = torch.tensor([prompt_ids]), torch.tensor([response_ids])
    mask = torch.ones(1, len(prompt_ids) + len(response_ids), dtype=torch.long)
    return DataProto.from_dict(tensors={"prompts": prompts, "responses": responses, "attention_mask": mask},
                               non_tensors={key: object_column([value]) for key, value in non_tensor.items()})


def rows_of(batch) -> list:
    """Each row of a padded verl batch (prompts left-padded, responses right-padded) without its padding."""
    prompts, responses, mask = batch.batch["prompts"], batch.batch["responses"], batch.batch["attention_mask"]
    width = prompts.shape[1]
    rows = []
    for i in range(len(batch)):
        prompt = prompts[i][mask[i, :width].bool()].tolist()
        response = responses[i][: int(mask[i, width:].sum())].tolist()
        rows.append(one_row(prompt, response, {k: v[i] for k, v in batch.non_tensor_batch.items()}))
    return rows


class RewardLoopScorer:
    """verl's `RewardLoopWorker` in this process, posting to the reward-model router at `router_address`
    ("ip:port"). `what` names the scorer in errors (the model path). Build it inside the event loop
    that scores (verl's reward managers keep the loop they were built in): RuntimeError otherwise."""

    def __init__(self, config, router_address: str):
        from verl.experimental.reward_loop.reward_loop import RewardLoopWorker

        asyncio.get_running_loop()  # RuntimeError outside a running loop

        patch_disrm_on_cpu()
        self.worker = RewardLoopWorker(config, router_address)
        custom = config.reward.custom_reward_function.get("path")
        self.what = (f"reward function {config.reward.custom_reward_function.get('name', 'compute_score')} "
                     f"with the reward model" if custom else f"reward model {config.reward.reward_model.model_path}")

    async def score(self, rows: list, timeout_s: float) -> tuple[torch.Tensor, list[tuple[int, str]]]:
        """(score of each row, the (row, cause) of each that raised or took over `timeout_s`, scored 0)."""
        async def one(row) -> tuple[float, Optional[str]]:
            try:
                result = await asyncio.wait_for(self.worker.compute_score(row), timeout=timeout_s)
                return float(result["reward_score"]), None
            except asyncio.TimeoutError:
                return 0.0, f"no score within reward.async_timeout_s={timeout_s:g} s"
            except Exception as exc:  # noqa: BLE001 - the user's function or the server may raise anything
                return 0.0, f"{type(exc).__name__}: {exc}"

        results = await asyncio.gather(*(one(row) for row in rows))
        failures = [(i, cause) for i, (_, cause) in enumerate(results) if cause is not None]
        return torch.tensor([value for value, _ in results], dtype=torch.float32), failures
