"""The CPU engine's own settings, read from verl's `actor_rollout_ref.rollout.engine_kwargs.cpu` map (where verl
keeps each backend's engine arguments: `engine_kwargs.vllm`, `engine_kwargs.sglang`). A key the table does not
hold is refused, naming the keys it does."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from async_rl.core.errors import AsyncConfigError

ENGINE_KWARGS_KEY = "actor_rollout_ref.rollout.engine_kwargs.cpu"


@dataclass(frozen=True)
class CpuEngineOptions:
    """admission_window_ms: how long (ms) a request waits for others before its prefill, so that requests
    arriving one by one share forwards; 0 (the default): a request joins the next step."""

    admission_window_ms: float = 0.0

    @classmethod
    def from_rollout_config(cls, rollout_config: Any) -> CpuEngineOptions:
        """The options under `engine_kwargs.cpu` of a verl rollout config (DictConfig, dataclass or mapping);
        AsyncConfigError naming the key for an unknown key or a value out of range."""
        engine_kwargs = _get(rollout_config, "engine_kwargs") or {}
        given = _get(engine_kwargs, "cpu") or {}
        if not isinstance(given, Mapping):
            raise AsyncConfigError(ENGINE_KWARGS_KEY, given, "a map of the CPU engine's options")
        known = list(cls.__dataclass_fields__)
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise AsyncConfigError(f"{ENGINE_KWARGS_KEY}.{unknown[0]}", given[unknown[0]],
                                   f"the CPU engine's options only: {', '.join(known)}")
        options = {}
        for name, value in given.items():
            try:
                options[name] = float(value)
            except (TypeError, ValueError):
                options[name] = float("nan")
            if not (math.isfinite(options[name]) and options[name] >= 0):
                raise AsyncConfigError(f"{ENGINE_KWARGS_KEY}.{name}", value, "finite milliseconds, 0 or more")
        return cls(**options)


def _get(section: Any, key: str) -> Any:
    """`section[key]` of a mapping (verl's configs are mappings, its DictConfigs too), or None."""
    return section.get(key) if hasattr(section, "get") else None
