"""verl's legacy top-level reward keys (`reward_model.*`, `custom_reward_function.*`, `sandbox_fusion.*`),
read as verl 0.9.1 reads them: its own `migrate_legacy_reward_impl`
(`verl/experimental/reward_loop/reward_loop.py`, applied by verl's fully-async trainer) maps them onto
`reward.*` (`reward_model.enable` -> `reward.reward_model.enable`, `reward_model.model.path` ->
`reward.reward_model.model_path`, `reward_model.rollout.*` -> `reward.reward_model.rollout.*`,
`reward_model.reward_manager` -> `reward.reward_manager.name`, `reward_model.reward_kwargs` ->
`reward.reward_kwargs`, `reward_model.num_workers` -> `reward.num_workers`, the other two sections whole).
The log names the legacy keys set and the new keys they became."""

from __future__ import annotations

import copy
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

LEGACY_SECTIONS = ("reward_model", "custom_reward_function", "sandbox_fusion")
# verl's default of `reward.custom_reward_function.name`; the legacy section's is null, which verl's
# migration copies and its `get_custom_reward_fn` then refuses (an assertion)
DEFAULT_REWARD_FUNCTION_NAME = "compute_score"


def _leaves(node: Any, prefix: str) -> dict[str, Any]:
    """Dotted key -> value of every leaf of `node` (a container) under `prefix`."""
    if isinstance(node, dict) and node:
        out = {}
        for name, child in node.items():
            out.update(_leaves(child, f"{prefix}.{name}"))
        return out
    return {prefix: node}


def legacy_keys_set(config: DictConfig) -> dict[str, Any]:
    """The legacy keys the command set (not null), dotted -> value."""
    found = {}
    for section in LEGACY_SECTIONS:
        node = config.get(section)
        if isinstance(node, DictConfig):
            found.update({k: v for k, v in _leaves(OmegaConf.to_container(node, resolve=False), section).items()
                          if v is not None and v != {}})
    return found


def migrate_legacy_reward_keys(config: DictConfig) -> tuple[DictConfig, str | None]:
    """(the config with the legacy keys mapped onto `reward.*` by verl's `migrate_legacy_reward_impl`, a
    log line naming what the command set and what it became; None when it set no legacy key). The
    legacy sections are gone from the returned config; `config` is left as it was."""
    from verl.experimental.reward_loop.reward_loop import migrate_legacy_reward_impl

    legacy = legacy_keys_set(config)
    if not legacy:
        return config, None
    before = _leaves(OmegaConf.to_container(config.reward, resolve=False), "reward")
    migrated = migrate_legacy_reward_impl(copy.deepcopy(config))
    function = migrated.reward.custom_reward_function
    if function.get("path") is not None and function.get("name") is None:
        with open_dict(function):
            function.name = DEFAULT_REWARD_FUNCTION_NAME
    after = _leaves(OmegaConf.to_container(migrated.reward, resolve=False), "reward")
    became = {k: v for k, v in after.items() if k not in before or before[k] != v}
    line = (f"verl's legacy keys {', '.join(f'{k}={v!r}' for k, v in legacy.items())}: read as verl 0.9.1's "
            f"migrate_legacy_reward_impl maps them, as {', '.join(f'{k}={v!r}' for k, v in became.items()) or 'verl defaults'}"
            " (write those keys instead)")
    return migrated, line
