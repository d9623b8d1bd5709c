"""The table of verl's keys (async_rl/core/verl_key_table.py) against the keys a run read, as recorded in every
process (async_rl/core/key_reads.py): `disagreements` lists each key whose row the record contradicts."""

from __future__ import annotations

from collections.abc import Callable

from async_rl.core.config import select_value
from async_rl.core.verl_key_table import Handling, KeyRow, row_for
from async_rl.core.verl_keys import leaf_keys, verl_defaults

# verl's modules the pipeline calls in place of verl's trainer (compute_advantage, get_custom_reward_fn,
# need_reference_policy, ...): a key one of them reads for the pipeline is the pipeline's
VERL_TRAINER = "verl.trainer."
# verl's entry point: it reads trainer.use_v1 to pick the task runner its run_ppo gets, and the flag's run_ppo
# (async_rl/plugin.py) ignores that runner; the pipeline acts on none of what it reads there for itself
VERL_ENTRY = "verl.trainer.main_ppo"


def _on(key: str, off=(None, False, 0, "", [], {})) -> Callable:
    return lambda config: select_value(config, key, None) not in off


def _reference_policy(config) -> bool:
    from verl.trainer.ppo.utils import need_reference_policy  # verl's rule, which the pipeline follows

    return bool(need_reference_policy(config))


# keys read only with a setting the recorded run leaves off: prefix -> (the setting, whether the run has it on).
# A key listed here that the run reads anyway, or whose setting the run has on and does not read, fails.
ONLY_WITH: dict[str, tuple[str, Callable]] = {
    # verl's compute_advantage reads pf_ppo only with use_pf_ppo (and only for GAE)
    "algorithm.pf_ppo": ("algorithm.use_pf_ppo", _on("algorithm.use_pf_ppo")),
    # the ref worker is built only with a reference policy (verl's need_reference_policy)
    "actor_rollout_ref.ref": ("actor.use_kl_loss or algorithm.use_kl_in_reward", _reference_policy),
    # verl's reward-model replicas are started only with reward.reward_model.enable
    **{f"reward.reward_model.{k}": ("reward.reward_model.enable", _on("reward.reward_model.enable"))
       for k in ("model_path", "rollout")},
    **{f"reward.reward_model.{k}": ("reward.reward_model.enable", _on("reward.reward_model.enable"))
       for k in ("enable_resource_pool", "n_gpus_per_node", "nnodes")},
    # verl's dataset loads a class of the user's only from data.custom_cls.path
    "data.custom_cls.name": ("data.custom_cls.path", _on("data.custom_cls.path")),
    # a reward manager's file is loaded only with source=importlib (async_rl/core/reward_loop_scoring.py)
    "reward.reward_manager.module": ("reward.reward_manager.source=importlib",
                                     lambda config: select_value(config, "reward.reward_manager.source", None)
                                     == "importlib"),
    # verl's sandbox client is built only with a sandbox url (verl's default_compute_score)
    **{f"reward.sandbox_fusion.{k}": ("reward.sandbox_fusion.url", _on("reward.sandbox_fusion.url"))
       for k in ("max_concurrent", "memory_limit_mb")},
    # verl's bypass-mode loss (async_rl/core/decoupled_ppo.py bypass_loss_settings) only with bypass_mode
    "algorithm.rollout_correction.loss_type": ("algorithm.rollout_correction.bypass_mode",
                                               _on("algorithm.rollout_correction.bypass_mode")),
    # the dynamic_sampling stage exists only with filter_groups.enable
    **{f"algorithm.filter_groups.{k}": ("algorithm.filter_groups.enable", _on("algorithm.filter_groups.enable"))
       for k in ("metric", "max_num_gen_batches")},
    # verl's KL controller in the reward (state_machines/actor_train.py) only with use_kl_in_reward
    "algorithm.kl_ctrl": ("algorithm.use_kl_in_reward", _on("algorithm.use_kl_in_reward")),
    # distillation's teachers and loss are built only with distillation.enabled (async_rl/rollout/teachers.py)
    **{f"distillation.{k}": ("distillation.enabled", _on("distillation.enabled"))
       for k in ("distillation_loss", "n_gpus_per_node", "nnodes", "teacher_models", "teacher_key")},
    # verl's RolloutSkip is built only with skip.rollout.enable (async_rl/rollout/rollout_dumps.py)
    **{f"skip.rollout.{k}": ("skip.rollout.enable", _on("skip.rollout.enable")) for k in ("dump_dir", "steps", "action")},
    # the standalone rollout's device count only with its nodes (async_rl/core/verl_async_keys.py standalone_rollout)
    "actor_rollout_ref.rollout.n_gpus_per_node": ("actor_rollout_ref.rollout.nnodes", _on("actor_rollout_ref.rollout.nnodes")),
    # the run's length in epochs only when trainer.total_training_steps is unset (async_rl/run_config.py)
    "trainer.total_epochs": ("trainer.total_training_steps unset",
                             lambda config: not select_value(config, "trainer.total_training_steps", None)),
}

# PIPELINE keys the pipeline reads from the verl dataclass it builds of their section (a `class` record whose
# `via` is the pipeline module that built it), not from the config
READ_FROM_CLASS = {"critic.ppo_max_token_len_per_gpu": "async_rl.training.worker_groups"}


def switched(row: KeyRow) -> bool:
    """A NO_EFFECT row of a subtree that acts only with its switch, which the table refuses (`switched` in the
    table): verl's classes may read it while the switch is off."""
    return row.handling is Handling.NO_EFFECT and row.where.startswith("acts only with ")


def keys_of(records: list[dict], test) -> set[str]:
    return {r["key"] for r in records if test(r)}


def _under(key: str, keys: set[str]) -> bool:
    """`key` or a key under it is in `keys` (a map verl's file leaves empty, filled by the command)."""
    return key in keys or any(k.startswith(key + ".") for k in keys)


def disagreements(records: list[dict], config) -> list[str]:
    """One line per key of verl's config whose row the record contradicts: a PIPELINE key the pipeline did not
    read or set, a VERL key no verl class or code got, a NO_EFFECT key someone read (but a switched subtree's);
    and an ONLY_WITH entry that does not hold (its key read with its setting off, or not read with it on)."""
    pipeline = keys_of(records, lambda r: r["how"] in ("read", "write") and (
        r["owner"] == "pipeline" or r["owner"] == "verl" and r["via"] and r["reader"].startswith(VERL_TRAINER))
        or r["how"] == "class" and READ_FROM_CLASS.get(r["key"]) == r["via"])
    verl = keys_of(records, lambda r: r["owner"] == "verl")
    anyone = keys_of(records, lambda r: r["how"] == "read" and r["reader"] != VERL_ENTRY)
    lines = []
    for key in leaf_keys(verl_defaults()):
        if key.rsplit(".", 1)[-1] == "_target_":  # which class a section becomes, not a setting
            continue
        row = row_for(key)
        expected = {Handling.PIPELINE: pipeline, Handling.VERL: verl}.get(row.handling)
        gate = next((p for p in ONLY_WITH if key == p or key.startswith(p + ".")), None)
        if gate is not None and expected is not None:
            setting, is_on = ONLY_WITH[gate]
            if not is_on(config) and _under(key, expected):
                lines.append(f"{key}: read with {setting} off: ONLY_WITH[{gate!r}] is wrong")
            if is_on(config) == _under(key, expected):
                continue
        if row.handling is Handling.PIPELINE and not _under(key, pipeline):
            lines.append(f"{key}: PIPELINE ({row.prefix}), not read or set by the pipeline")
        elif row.handling is Handling.VERL and not _under(key, verl):
            lines.append(f"{key}: VERL ({row.prefix}), reached no verl class or code")
        elif row.handling is Handling.NO_EFFECT and not switched(row) and _under(key, anyone):
            readers = sorted({r["reader"] for r in records if r["key"] == key and r["how"] == "read"} - {VERL_ENTRY})
            lines.append(f"{key}: NO_EFFECT ({row.prefix}), read by {', '.join(readers)}")
    return lines
