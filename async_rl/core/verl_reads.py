"""Which keys verl 0.9.1 reads, and the check that a key a command adds (`+a.b.c=...`) is read by verl or by the
pipeline (`refuse_unread_keys`): one neither reads is refused before Ray starts, naming it and its nearest keys.

What verl reads, section by section:

- the keys of its PPO config (`_generated_ppo_trainer.yaml`, `verl_keys.verl_defaults`);
- the fields of the classes its sections become (`_target_` in that file: `FSDPActorConfig`, `RolloutConfig`,
  ...; verl builds them with `omega_conf_to_dataclass`), those the file leaves out too;
- what its code reads with `.get` beyond both (`OUTSIDE_YAML`, each with its reader; checked against verl's
  source by tests/core/test_verl_reads.py).

A map whose keys are the user's stays the user's: a field typed `dict` or `Any` (`override_config`,
`engine_kwargs`, `wrap_policy`, ...), a map empty in verl's file (`apply_chat_template_kwargs`), and the
`FREE_FORM` maps (`ray_kwargs.ray_init`, `reward.reward_kwargs`, ...). The pipeline's own keys are
`config.KEYS`."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import typing
from dataclasses import dataclass
from typing import Any, Optional

from omegaconf import OmegaConf

from async_rl.core.config import CONFIG_KEYS, select_value
from async_rl.core.errors import AsyncConfigError
from async_rl.core.key_reads import not_a_use
from async_rl.core.verl_keys import leaf_keys, verl_defaults

# keys of the config main_ppo composes that its generated file lacks: the defaults list's engine choice
COMPOSED_ONLY = ("model_engine",)


@dataclass(frozen=True)
class OutsideYaml:
    """A key verl 0.9.1's code reads (`reader`: its module) that its PPO config file does not list.

    `flag_on`: who reads it with the flag (None: no one; `why` says so in the refusal). `free_form`: a map whose
    keys are the user's."""

    key: str
    reader: str
    flag_on: Optional[str]
    why: str = ""
    free_form: bool = False


OUTSIDE_YAML = (
    OutsideYaml("reward.reward_kwargs", "verl.experimental.reward_loop.reward_manager.dapo",
                "the reward stage (async_rl/core/scoring.py: dapo's overlong buffer)", free_form=True),
    OutsideYaml("reward.custom_reward_function.reward_kwargs", "verl.trainer.ppo.reward",
                "verl's get_custom_reward_fn in the reward stage", free_form=True),
    *(OutsideYaml(f"data.{k}", "verl.utils.dataset.rl_dataset", "verl's RLHFDataset (async_rl/core/prompts.py)")
      for k in ("cache_dir", "chat_template_func", "need_tools_kwargs", "filter_prompts")),
    OutsideYaml("trainer.wandb_proxy", "verl.utils.tracking", "verl's Tracking (async_rl/pipeline.py)"),
    OutsideYaml("trainer.remove_previous_ckpt_in_save", "verl.trainer.ppo.ray_trainer",
                "async_rl/checkpoints.py: max_actor_ckpt_to_keep=1, as verl's trainer reads it"),
    OutsideYaml("actor_rollout_ref.rollout.checkpoint_manager_class", "verl.trainer.ppo.ray_trainer", None,
                "verl's trainer loads this weight-sync class; the async pipeline's own weight sync moves the weights"),
    OutsideYaml("reward.timeout", "verl.experimental.reward_loop.reward_manager.limited", None,
                "only verl's `limited` reward manager reads it, and the async pipeline runs naive or dapo"),
    OutsideYaml("reward_model.reward_kwargs", "verl.experimental.reward_loop.reward_loop", None,
                "the legacy key, which verl 0.9.1's main_ppo does not read either (only fully_async_policy "
                "migrates it): set reward.reward_kwargs", free_form=True),
    OutsideYaml("custom_reward_function.reward_kwargs", "verl.experimental.reward_loop.reward_loop", None,
                "the legacy key, which verl 0.9.1's main_ppo does not read either: set "
                "reward.custom_reward_function.reward_kwargs", free_form=True),
)
_OUTSIDE = {row.key: row for row in OUTSIDE_YAML}

# maps outside verl's classes whose keys are the user's (each passed on whole)
FREE_FORM = {
    "ray_kwargs.ray_init": "ray.init's arguments",
}


@dataclass(frozen=True)
class Reading:
    """Who reads an added key: `reader` (None: no one) and, when no one does, `why` or the nearest keys."""

    key: str
    reader: Optional[str]
    why: str = ""
    nearest: tuple = ()


def _load(target: str):
    module, _, name = target.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _unwrap(annotation):
    """`Optional[X]` -> X."""
    if typing.get_origin(annotation) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return _unwrap(args[0])
    return annotation


def _is_map(annotation) -> bool:
    """A field whose keys are the user's: typed dict (any parameters), Any, or a union not of one class."""
    annotation = _unwrap(annotation)
    origin = typing.get_origin(annotation) or annotation
    if annotation is Any or typing.get_origin(annotation) is typing.Union:
        return True
    return isinstance(origin, type) and issubclass(origin, dict)


@functools.cache
def _fields(cls) -> dict:
    """Field name -> its annotation, for a dataclass."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(cls)}


def _names_at(node, cls) -> list[str]:
    """The keys verl knows one level below a section (its file's and its class's)."""
    names = list(node) if isinstance(node, dict) else []
    return names + [name for name in (_fields(cls) if cls else {}) if name not in names and not name.startswith("_")]


def _ours(prefix: str) -> list[str]:
    """The pipeline's key names one level below `prefix`."""
    return [k[len(prefix) + 1:].split(".")[0] if prefix else k.split(".")[0]
            for k in CONFIG_KEYS if not prefix or k.startswith(prefix + ".")]


def _outside(prefix: str) -> list[str]:
    return [row.key[len(prefix) + 1:].split(".")[0] if prefix else row.key.split(".")[0]
            for row in OUTSIDE_YAML if not prefix or row.key.startswith(prefix + ".")]


@functools.cache
def _known_keys() -> tuple[str, ...]:
    """Every key verl's file lists, those of OUTSIDE_YAML and the pipeline's (for the nearest keys)."""
    return (*leaf_keys(verl_defaults()), *_OUTSIDE, *CONFIG_KEYS)


def nearest_keys(key: str, section: str, names: list[str], n: int = 3) -> tuple[str, ...]:
    """The keys nearest to `key`, however far: the section's names most like its next part, then keys
    elsewhere that end as it does (`reward_model.reward_kwargs` -> `reward.reward_kwargs`)."""
    name = key[len(section) + 1:].split(".")[0] if section else key.split(".")[0]
    unique = list(dict.fromkeys(names))
    near = [f"{section}.{m}" if section else m for m in difflib.get_close_matches(name, unique, n=n, cutoff=0.0)]
    tail = key.split(".", 1)[1] if "." in key else key
    same_end = [k for k in _known_keys() if k != key and (k.endswith("." + tail) or k.endswith("." + name))]
    return tuple(dict.fromkeys(same_end[:2] + near))[:n + 1]


def reading_of(key: str) -> Reading:
    """Who reads `key` (dotted) with the flag: the pipeline (`config.KEYS`), verl (its file, its classes,
    OUTSIDE_YAML), the user (a free-form map), or no one."""
    if any(key == k or key.startswith(k + ".") for k in CONFIG_KEYS):
        return Reading(key, "the async pipeline (async_rl/core/config.py KEYS)")
    if key.split(".")[0] in COMPOSED_ONLY:
        return Reading(key, "verl's ppo_trainer.yaml (its defaults list)")
    for prefix, row in _OUTSIDE.items():
        if key == prefix or key.startswith(prefix + ".") and row.free_form:
            return Reading(key, row.flag_on, row.why)
    for prefix, what in FREE_FORM.items():
        if key.startswith(prefix + "."):
            return Reading(key, f"the user's: {prefix} is {what}")
    node, cls, section = verl_defaults(), None, ""  # verl's file at `section` ({}: only its class knows it)
    for part in key.split("."):
        if isinstance(node, dict) and node.get("_target_"):
            cls = _load(node["_target_"])
        annotation = _fields(cls).get(part) if cls is not None else None
        if annotation is not None and _is_map(annotation):
            return Reading(key, f"the user's: {section}.{part} is a map of verl's {cls.__name__}")
        child = _unwrap(annotation) if annotation is not None and dataclasses.is_dataclass(_unwrap(annotation)) else None
        if isinstance(node, dict) and part in node:
            node, cls = node[part], child
        elif child is not None:  # a class of verl's, absent from its file
            node, cls = {}, child
        elif annotation is not None:
            return Reading(key, f"verl's {cls.__name__}")
        elif not isinstance(node, dict):
            return Reading(key, f"the user's: under {section}, a value verl's file leaves open")
        elif not node and cls is None:
            return Reading(key, f"the user's: {section} is a map")
        else:
            names = _names_at(node, cls) + _ours(section) + _outside(section)
            return Reading(key, None, nearest=nearest_keys(key, section, names))
        section = f"{section}.{part}" if section else part
    return Reading(key, "verl's ppo_trainer config")


@not_a_use
def refuse_unread_keys(config) -> None:
    """Raise AsyncConfigError for the first key of `config` that neither verl nor the pipeline reads (a key
    the command added: verl's own file lists the rest), naming it and its nearest keys; or that only verl's
    own trainer reads, naming why. Keys under free-form maps are the user's."""
    listed = set(leaf_keys(verl_defaults()))
    for key in leaf_keys(OmegaConf.to_container(config, resolve=False)):
        if key in listed:
            continue
        reading = reading_of(key)
        if reading.reader is not None:
            continue
        value = select_value(config, key, None)
        if reading.why:
            raise AsyncConfigError(key, value, f"nothing: {reading.why}")
        raise AsyncConfigError(key, value, "a key verl or the async pipeline reads; neither reads this one "
                                           f"(nearest: {', '.join(reading.nearest)})")
