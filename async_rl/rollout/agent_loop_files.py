"""What the agent loops need from a command, checked before Ray starts: the agent-loop, tool, interaction and
router files (each exists, loads and imports, and every loop a run asks for is registered), written then as
absolute paths for the stages, whose Ray workers do not share the driver's working directory; and the package
of the rollout trace's backend."""

from __future__ import annotations

import importlib.util
import os

import hydra
from omegaconf import OmegaConf, open_dict
from verl.experimental.agent_loop.agent_loop import _agent_loop_registry
from verl.utils.import_utils import resolve_config_path

from async_rl.core.errors import AsyncConfigError
from async_rl.rollout.routing import ROUTER_KEY, check_router_file

AGENT_LOOP_KEY = "actor_rollout_ref.rollout.agent.default_agent_loop"
AGENT_LOOP_CONFIG_KEY = "actor_rollout_ref.rollout.agent.agent_loop_config_path"
TOOL_CONFIG_KEY = "actor_rollout_ref.rollout.multi_turn.tool_config_path"
MULTI_TURN_FILES = ("tool_config_path", "interaction_config_path", "function_tool_path")
TRACE_BACKEND_KEY = "actor_rollout_ref.rollout.trace.backend"
TRACE_PACKAGES = {"weave": "weave", "mlflow": "mlflow", "trackio": "trackio"}  # verl's backends -> their package


def check_trace_backend(config) -> None:
    """At start: `rollout.trace.backend` is None or one of verl's backends whose package imports here (verl's
    agent-loop worker imports it in the generate stage). Raises AsyncConfigError naming the key."""
    backend = (config.actor_rollout_ref.rollout.get("trace") or {}).get("backend")
    if backend is None:
        return
    if backend not in TRACE_PACKAGES:
        raise AsyncConfigError(TRACE_BACKEND_KEY, backend,
                               f"None or one of verl's trace backends: {', '.join(TRACE_PACKAGES)}")
    if importlib.util.find_spec(TRACE_PACKAGES[backend]) is None:
        raise AsyncConfigError(TRACE_BACKEND_KEY, backend, f"a backend whose package is installed (pip install "
                               f"{TRACE_PACKAGES[backend]}; the generate stage imports it)")


def _agent_files(config) -> dict[str, str]:
    """key -> the path set there, for every agent-loop file key of the config."""
    rollout = config.actor_rollout_ref.rollout
    files = {AGENT_LOOP_CONFIG_KEY: rollout.agent.get("agent_loop_config_path"),
             ROUTER_KEY: rollout.get("router_config_path")}
    multi_turn = rollout.get("multi_turn") or {}
    files.update({f"actor_rollout_ref.rollout.multi_turn.{key}": multi_turn.get(key) for key in MULTI_TURN_FILES})
    return {key: str(path) for key, path in files.items() if path}


def check_agent_loops(config, data_agent_names: frozenset = frozenset()) -> None:
    """At start: every agent-loop, tool, interaction and router file exists, the agent-loop file loads and its
    `_target_`s import, the tool file's and the router file's classes import, and
    `rollout.agent.default_agent_loop` and every `agent_name` of the data (`data_agent_names`) is a registered
    loop. Raises AsyncConfigError naming the key."""
    for key, path in _agent_files(config).items():
        try:
            found = os.path.isfile(resolve_config_path(path))
        except FileNotFoundError:
            found = False
        if not found:
            raise AsyncConfigError(key, path, "an existing file")
    tools = (config.actor_rollout_ref.rollout.get("multi_turn") or {}).get("tool_config_path")
    if tools:
        check_tool_classes(tools)
    if config.actor_rollout_ref.rollout.get("router_config_path"):
        check_router_file(ROUTER_KEY, str(config.actor_rollout_ref.rollout.router_config_path))
    names = set(_agent_loop_registry)
    path = config.actor_rollout_ref.rollout.agent.get("agent_loop_config_path")
    if path:
        try:
            targets = {str(entry.name): str(entry._target_) for entry in OmegaConf.load(resolve_config_path(path))}
        except Exception as exc:  # noqa: BLE001 - any unreadable file is the same user error
            raise AsyncConfigError(AGENT_LOOP_CONFIG_KEY, path,
                                   f"a YAML list of {{name, _target_}} entries ({type(exc).__name__}: {exc})") from None
        for name, target in targets.items():
            try:
                loaded = hydra.utils.get_object(target)  # as loop_factory resolves it in the stage
            except Exception as exc:  # noqa: BLE001
                raise AsyncConfigError(AGENT_LOOP_CONFIG_KEY, path, f"agent loop {name!r}: _target_ {target} "
                                       f"that imports ({type(exc).__name__}: {exc})") from None
            if not callable(loaded):
                raise AsyncConfigError(AGENT_LOOP_CONFIG_KEY, path, f"agent loop {name!r}: a class as _target_")
        names |= set(targets)
    registered = f"a registered agent loop: {', '.join(sorted(names))}"
    default = str(config.actor_rollout_ref.rollout.agent.default_agent_loop)
    if default not in names:
        raise AsyncConfigError(AGENT_LOOP_KEY, default, registered)
    for name in sorted(set(data_agent_names) - names):
        raise AsyncConfigError("agent_name (a column of data.train_files / data.val_files)", name, registered)


def check_tool_classes(path: str) -> None:
    """Every `class_name` of the tool config at `path` imports, as verl's agent-loop worker loads it (else
    AsyncConfigError naming the key, the file and the class)."""
    try:
        tools = OmegaConf.load(resolve_config_path(path)).get("tools") or []
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same user error
        raise AsyncConfigError(TOOL_CONFIG_KEY, path, f"a YAML file with a `tools` list ({type(exc).__name__}: {exc})") from None
    for tool in tools:
        try:
            hydra.utils.get_class(str(tool.class_name))
        except Exception as exc:  # noqa: BLE001
            cause = exc.__cause__ or exc
            raise AsyncConfigError(TOOL_CONFIG_KEY, path, f"a tool config whose classes import: class_name "
                                   f"{tool.class_name} does not ({type(cause).__name__}: {cause})") from None


def absolute_agent_files(config) -> None:
    """Write every agent-loop, tool and interaction file key as an absolute path (in place): the stages
    that read them run in Ray workers whose working directory is not the driver's."""
    for key, path in _agent_files(config).items():
        parent, _, leaf = key.rpartition(".")
        section = OmegaConf.select(config, parent)
        with open_dict(section):
            section[leaf] = resolve_config_path(path)
