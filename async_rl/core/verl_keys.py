"""verl 0.9.1 settings the pipeline cannot honour: each is refused before Ray starts, naming its key and
why, never ignored (`refuse_unsupported`). Two kinds: a key the table (`verl_key_table.VERL_KEYS`) marks
REFUSED, set to anything but verl's default; and a value of a key otherwise honoured (`UNSUPPORTED`: an
estimator, a strategy). A row leaves when the pipeline learns to run it (issue 40: reward models on vLLM
and SGLang, LoRA on vLLM)."""

from __future__ import annotations

import copy
import functools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

from async_rl.core.config import CONFIG_KEYS, select_value
from async_rl.core.decoupled_ppo import BYPASS_LOSS_MODE, LOSS_MODE, bypass_loss_settings
from async_rl.core.errors import AsyncConfigError
from async_rl.core.key_reads import not_a_use
from async_rl.core.verl_key_table import VERL_KEYS, Handling, row_for

OPTIMAL_TOKEN_BASELINES = ("optimal_token_baseline", "tir_optimal_token_baseline")
FSDP_STRATEGIES = ("fsdp", "fsdp2")
STRATEGY_KEYS = ("actor_rollout_ref.actor.strategy", "actor_rollout_ref.ref.strategy", "critic.strategy")
ABSENT = object()


@dataclass(frozen=True)
class Unsupported:
    """`key` set to a value for which `refuses(value)` is true cannot run under the flag; `allowed`
    says what can, `why` what is missing."""

    key: str
    refuses: Callable[[Any], bool]
    allowed: str
    why: str


PROFILER_TOOLS = ("torch", "torch_memory")  # `global_profiler.tool` values verl's workers run under the flag

UNSUPPORTED = (
    Unsupported("algorithm.adv_estimator", lambda v: v in OPTIMAL_TOKEN_BASELINES,
                f"any estimator but {' / '.join(OPTIMAL_TOKEN_BASELINES)}",
                "the optimal token baseline needs `sum_pi_squared` from the actor's log-prob pass, which the "
                "pipeline's pass does not return"),
    *(Unsupported(key, lambda v: v not in FSDP_STRATEGIES, " or ".join(FSDP_STRATEGIES),
                  "the weight sync gathers the trainer's FSDP shards") for key in STRATEGY_KEYS),
    Unsupported("global_profiler.tool", lambda v: v not in (None, *PROFILER_TOOLS), " or ".join(PROFILER_TOOLS),
                "verl's workers profile with these here; nsys, npu and the precision debugger need GPUs or NPUs "
                "and their tools, untested here"),
)

LORA_RANK = "actor_rollout_ref.model.lora_rank"
# whose servers take the adapter under the flag: the CPU backend merges it (async_rl/rollout/cpu/server.py),
# vLLM serves it through its LoRA support (param_update/verl_engine.py load_versions_as_adapter)
LORA_BACKENDS = ("cpu", "vllm")

REWARD_MODEL = "reward.reward_model"
REWARD_MODEL_BACKENDS = ("cpu", "vllm")  # whose reward-model servers the pipeline starts (async_rl/rollout/reward_models.py)

BYPASS = "algorithm.rollout_correction.bypass_mode"

PROMETHEUS = "actor_rollout_ref.rollout.prometheus.enable"
# whose servers export /metrics at their address (the CPU server has no HTTP endpoint)
PROMETHEUS_BACKENDS = ("vllm",)


@functools.cache
def verl_defaults() -> dict:
    """verl 0.9.1's full PPO config as it ships (`_generated_ppo_trainer.yaml`), interpolations unresolved."""
    import verl.trainer.config as configs

    with open(os.path.join(os.path.dirname(configs.__file__), "_generated_ppo_trainer.yaml")) as f:
        return yaml.safe_load(f)


def leaf_keys(node, prefix: str = "") -> Iterator[str]:
    """The dotted keys of the leaves of `node` (nested dicts; an empty one is a leaf), under `prefix`."""
    if isinstance(node, dict) and node:
        for name, child in node.items():
            yield from leaf_keys(child, f"{prefix}.{name}" if prefix else str(name))
    else:
        yield prefix


def raw_default(key: str):
    """verl's default of `key` as written (an interpolation stays a string)."""
    node = verl_defaults()
    for part in key.split("."):
        node = node[part]
    return node


def default_in(config, key: str):
    """verl's default of `key` as `config` would resolve it (an interpolation such as
    `${oc.select:trainer.n_gpus_per_node,8}` against the command's other keys)."""
    raw = raw_default(key)
    if not (isinstance(raw, str) and "${" in raw):
        return raw
    probe = copy.deepcopy(config)
    OmegaConf.update(probe, key, raw, merge=False, force_add=True)
    return select_value(probe, key, None)


def set_away_from_default(config, handling: Handling) -> Iterator[tuple[str, Any, Any]]:
    """(key, value, verl's default) of each key of `config` whose row is `handling` and whose value is not
    verl's default."""
    for row in VERL_KEYS:
        if row.handling is not handling:
            continue
        for key in leaf_keys(raw_default(row.prefix), row.prefix):
            value = select_value(config, key, ABSENT)  # absent: a config composed from another file
            if row_for(key) is not row or value is ABSENT:  # a longer row decides it
                continue
            default = default_in(config, key)
            if value != default:
                yield key, value, default


@not_a_use  # it reads every key to compare it with verl's default
def refuse_unsupported(config) -> None:
    """Raise AsyncConfigError for the first key of `config` the table refuses that is set away from verl's
    default, the first setting in UNSUPPORTED, or verl's bypass-mode loss beside a loss mode of the
    actor's own (naming both keys)."""
    refused = next(set_away_from_default(config, Handling.REFUSED), None)
    if refused is not None:
        key, value, default = refused
        raise AsyncConfigError(key, value, f"verl's default {default!r} (the async pipeline: {row_for(key).where})")
    for rule in UNSUPPORTED:
        value = select_value(config, rule.key, None)
        if value is not None and rule.refuses(value):
            raise AsyncConfigError(rule.key, value, f"{rule.allowed} (the async pipeline: {rule.why})")
    backend = select_value(config, "actor_rollout_ref.rollout.name", None)
    if (select_value(config, LORA_RANK, 0) or 0) > 0 and backend not in LORA_BACKENDS:
        raise AsyncConfigError(LORA_RANK, select_value(config, LORA_RANK, 0),
                               f"0 with actor_rollout_ref.rollout.name={backend} (the async pipeline sends a LoRA "
                               f"adapter to rollout.name={' or '.join(LORA_BACKENDS)}; SGLang's adapter loading is "
                               "untested: no run of verl's SGLang rollout has completed here yet, docs/sglang_cpu.md)")
    if select_value(config, PROMETHEUS, False) is True and backend not in PROMETHEUS_BACKENDS:
        raise AsyncConfigError(PROMETHEUS, True, f"False with actor_rollout_ref.rollout.name={backend} (Prometheus "
                               f"scrapes /metrics at each server's address: {' or '.join(PROMETHEUS_BACKENDS)}'s "
                               "servers export them and run here; the CPU server has no HTTP endpoint)")
    if select_value(config, f"{REWARD_MODEL}.enable", False) is True:
        rm_backend = select_value(config, f"{REWARD_MODEL}.rollout.name", None)
        if rm_backend not in REWARD_MODEL_BACKENDS:
            raise AsyncConfigError(f"{REWARD_MODEL}.rollout.name", rm_backend,
                                   f"{' or '.join(REWARD_MODEL_BACKENDS)} (the async pipeline starts the reward "
                                   "model's servers on the CPU backend and on vLLM; no run has served a reward "
                                   "model on SGLang's CPU build here, docs/sglang_cpu.md)")
        if rm_backend != "cpu" and select_value(config, f"{REWARD_MODEL}.enable_resource_pool", False) is not True:
            raise AsyncConfigError(f"{REWARD_MODEL}.enable_resource_pool", False,
                                   f"True with {REWARD_MODEL}.rollout.name={rm_backend}: its servers need devices of "
                                   f"their own ({REWARD_MODEL}.nnodes x n_gpus_per_node); the pipeline's stages use "
                                   "theirs all at once, so there is no phase to colocate a reward model in")
    bypass_loss = bypass_loss_settings(config) if isinstance(config, DictConfig) else {}
    loss_mode = select_value(config, LOSS_MODE, "vanilla")
    if bypass_loss and loss_mode not in ("vanilla", BYPASS_LOSS_MODE):
        given = ", ".join(f"algorithm.rollout_correction.{k}={v!r}" for k, v in bypass_loss.items())
        raise AsyncConfigError(LOSS_MODE, loss_mode, f"vanilla with {BYPASS}=True and {given}: verl's bypass-mode "
                                                     "loss takes the actor's place, PPO-clip or REINFORCE "
                                                     "(algorithm.rollout_correction.loss_type), so a loss mode of "
                                                     "its own cannot apply beside it")


@not_a_use
def replaced_settings(config) -> list[str]:
    """One line per key the command set that the pipeline does its own way (the table's REPLACED rows)."""
    return [f"{key}={value!r} is not used: {row_for(key).where}"
            for key, value, _ in set_away_from_default(config, Handling.REPLACED)]
