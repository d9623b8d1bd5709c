"""Scoring through verl 0.9.1's own reward loop (`RewardLoopWorker`), for the reward stage and validation
when the run needs what only verl's reward managers do (`uses_reward_loop`): a reward model
(`reward.reward_model.enable=True`, over the run's reward-model router), a reward manager other than the
pipeline's naive / dapo scoring (a registered `reward.reward_manager.name` such as `gdpo`, `remote`, or
one from a file: `reward.reward_manager.source=importlib` with `module.path`), or a code sandbox
(`reward.sandbox_fusion.url`, which verl passes to `default_compute_score`).

verl's rules, unchanged: with `reward.custom_reward_function.path` the user's function scores and is
given `reward_router_address` and `reward_model_tokenizer` (how verl combines a rule reward with a
reward model, or runs a generative one); without, the discriminative reward model scores the
response under its chat template, or the reward manager with verl's `default_compute_score`. Each row
is scored on its own, under a deadline (s), so one that hangs or raises is named (`reward.on_error`).
"""

from __future__ import annotations

import asyncio
from typing import Optional

import torch

from async_rl.core.messages import object_column
from verl_patches.cpu_reward_model import patch_disrm_on_cpu


PIPELINE_MANAGERS = ("naive", "dapo")  # reward managers the pipeline's own scoring equals (async_rl/core/scoring.py)


def uses_reward_loop(config) -> bool:
    """Whether scoring goes through verl's reward loop: a reward model, a reward manager other than a
    registered naive / dapo, or `reward.sandbox_fusion.url`."""
    reward = config.reward
    manager = reward.reward_manager
    return bool(reward.reward_model.get("enable", False) or manager.get("source", "register") != "register"
                or manager.get("name", "naive") not in PIPELINE_MANAGERS
                or (reward.get("sandbox_fusion") or {}).get("url"))


def check_reward_manager(config) -> None:
    """verl's reward manager class resolves (a registered name, or the class in `module.path`), before
    Ray starts; ValueError naming the key otherwise."""
    from verl.trainer.ppo.reward import resolve_reward_manager_cls

    manager = config.reward.reward_manager
    try:
        resolve_reward_manager_cls(config)
    except Exception as exc:  # noqa: BLE001 - verl's registry and loader raise several kinds
        key = ("reward.reward_manager.name" if manager.get("source", "register") == "register"
               else "reward.reward_manager.module.path")
        raise ValueError(f"{key}: verl's reward manager {manager.get('name')!r} "
                         f"(source {manager.get('source', 'register')!r}, module.path "
                         f"{(manager.get('module') or {}).get('path')!r}) cannot be loaded: "
                         f"{type(exc).__name__}: {exc}") from exc


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
    ("ip:port"; None without a reward model). `what` names the scorer in errors (the function, the model
    path or the reward manager). Build it inside the event loop that scores (verl's reward managers keep
    the loop they were built in): RuntimeError otherwise."""

    def __init__(self, config, router_address: str | None):
        from verl.experimental.reward_loop.reward_loop import RewardLoopWorker

        asyncio.get_running_loop()  # RuntimeError outside a running loop

        patch_disrm_on_cpu()
        self.worker = RewardLoopWorker(config, router_address)
        custom = config.reward.custom_reward_function.get("path")
        model = config.reward.reward_model.get("enable", False)
        manager = config.reward.reward_manager.get("name")
        if custom:
            self.what = (f"reward function {config.reward.custom_reward_function.get('name', 'compute_score')}"
                         + (" with the reward model" if model else f" in verl's reward manager {manager}"))
        else:
            self.what = (f"reward model {config.reward.reward_model.model_path}" if model
                         else f"verl's reward manager {manager} with default_compute_score")

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
