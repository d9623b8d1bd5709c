"""Calls into verl's engine worker groups, with verl's own padding conversions.

These mirror `RayPPOTrainer._compute_old_log_prob`, `_compute_ref_log_prob` and
`_update_actor` (verl 0.9.1): DataProto -> TensorDict -> no-padding -> worker ->
padding. The stages call these instead of re-implementing the data plumbing.
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig
from verl import DataProto
from verl.utils import tensordict_utils as tu
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

from async_rl.core.messages import MULTI_MODAL_INPUTS

# Tensors the engines need; the rest of the batch stays with the stage.
_ENGINE_KEYS = ("input_ids", "attention_mask", "position_ids", "response_mask", "prompts", "responses")
_TRAIN_KEYS = _ENGINE_KEYS + ("old_log_probs", "ref_log_prob", "advantages", "rollout_log_probs", "rollout_is_weights",
                               "teacher_ids", "teacher_logprobs")


def _to_no_padding(batch: DataProto, keys: tuple[str, ...]):
    """`keys` of the batch (those present) and, for a multimodal model, its `multi_modal_inputs`, in verl's
    no-padding layout."""
    present = [k for k in keys if k in batch.batch.keys()]
    non_tensor = [MULTI_MODAL_INPUTS] if MULTI_MODAL_INPUTS in batch.non_tensor_batch else []
    td = batch.select(batch_keys=present, non_tensor_batch_keys=non_tensor).to_tensordict()
    return left_right_2_no_padding(td)


def compute_log_prob(worker_group, batch: DataProto, temperature: float) -> torch.Tensor:
    """Log-probs of the responses under the worker group's current weights, (bs, resp_len)."""
    td = _to_no_padding(batch, _ENGINE_KEYS)
    tu.assign_non_tensor(td, calculate_entropy=False, compute_loss=False, temperature=temperature)
    output = worker_group.compute_log_prob(td)
    return no_padding_2_padding(tu.get(output, "log_probs"), td).float()


def compute_ref_log_prob(worker_group, batch: DataProto, temperature: float) -> torch.Tensor:
    """Log-probs under the frozen reference model, (bs, resp_len)."""
    td = _to_no_padding(batch, _ENGINE_KEYS)
    tu.assign_non_tensor(td, calculate_entropy=False, compute_loss=False, temperature=temperature)
    output = worker_group.compute_ref_log_prob(td)
    return no_padding_2_padding(tu.get(output, "log_probs"), td).float()


def distillation_flags(distillation: DictConfig | None) -> dict[str, bool]:
    """verl's `distillation_use_topk` and `distillation_only` of an actor update (`RayPPOTrainer._update_actor`):
    a top-k loss; and, with it, neither task rewards nor the policy gradient (no policy loss)."""
    if distillation is None or not distillation.get("enabled", False):
        return {"distillation_use_topk": False, "distillation_only": False}
    from verl.trainer.distillation.losses import get_distillation_loss_settings

    loss = distillation.distillation_loss
    use_topk = bool(get_distillation_loss_settings(str(loss.loss_mode)).use_topk)
    return {"distillation_use_topk": use_topk,
            "distillation_only": use_topk and not loss.use_task_rewards and not loss.use_policy_gradient}


def update_actor(worker_group, batch: DataProto, actor_rollout_ref: DictConfig,
                 distillation: DictConfig | None = None) -> dict[str, float]:
    """One PPO update over `batch` (verl's mini-batches and epochs; with `distillation` enabled, verl's
    distillation loss on the batch's teacher scores); returns verl's actor metrics."""
    actor_cfg = actor_rollout_ref.actor
    td = _to_no_padding(batch, _TRAIN_KEYS)
    # a filtered batch may hold fewer rows than one configured mini-batch: train it as one
    mini_batch = min(int(actor_cfg.ppo_mini_batch_size) * int(actor_rollout_ref.rollout.n), len(batch))
    tu.assign_non_tensor(
        td,
        calculate_entropy=bool(actor_cfg.get("calculate_entropy", False) or actor_cfg.entropy_coeff != 0.0),
        **distillation_flags(distillation),
        global_batch_size=mini_batch,
        mini_batch_size=mini_batch,
        epochs=actor_cfg.ppo_epochs,
        seed=actor_cfg.data_loader_seed,
        dataloader_kwargs={"shuffle": actor_cfg.shuffle},
        compute_loss=True,
        temperature=actor_rollout_ref.rollout.temperature,
        multi_turn=False,
    )
    output = worker_group.update_actor(td)
    metrics = tu.get(output, "metrics")
    out = {}
    for key, value in metrics.items():
        name = "perf/mfu/actor" if key == "mfu" else (key if key.startswith("actor/") else f"actor/{key}")
        if isinstance(value, (list, tuple)):
            value = sum(value) / max(len(value), 1)
        out[name] = float(value)
    return out


# Tensors verl's critic reads: the engine keys, the values it predicted, GAE's returns.
_CRITIC_TRAIN_KEYS = _ENGINE_KEYS + ("values", "returns")


def compute_values(worker_group, batch: DataProto, temperature: float) -> torch.Tensor:
    """The critic's values of every response token, (bs, resp_len) (verl's `_compute_values`; the
    engine reads the rollout's `temperature`, which verl's batch carries in its meta_info)."""
    td = _to_no_padding(batch, _ENGINE_KEYS)
    tu.assign_non_tensor(td, compute_loss=False, temperature=temperature)
    output = worker_group.infer_batch(td).get()
    return no_padding_2_padding(tu.get(output, "values"), td).float()


def update_critic(worker_group, batch: DataProto, config: DictConfig) -> dict[str, float]:
    """verl's critic update over `batch` (`critic.ppo_mini_batch_size` x n rows per mini-batch,
    `critic.ppo_epochs`; verl's `_update_critic`); returns verl's metrics (`critic/*`, `perf/mfu/critic`)."""
    critic = config.critic
    td = _to_no_padding(batch, _CRITIC_TRAIN_KEYS)
    mini_batch = min(int(critic.ppo_mini_batch_size) * int(config.actor_rollout_ref.rollout.n), len(batch))
    tu.assign_non_tensor(
        td,
        global_batch_size=mini_batch,
        mini_batch_size=mini_batch,
        epochs=critic.ppo_epochs,
        seed=critic.data_loader_seed,
        dataloader_kwargs={"shuffle": critic.shuffle},
        temperature=config.actor_rollout_ref.rollout.temperature,
    )
    from verl.utils.metric import reduce_metrics
    from verl.utils.py_functional import rename_dict

    metrics = rename_dict(tu.get(worker_group.train_mini_batch(td).get(), "metrics"), "critic/")
    if "critic/mfu" in metrics:
        metrics["perf/mfu/critic"] = metrics.pop("critic/mfu")
    return {key: float(value) for key, value in reduce_metrics(metrics).items()}
