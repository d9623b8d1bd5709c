"""The weight-sync interface the param_update stage drives.

`WeightSync.sync(version, started_at)` makes `version` the weights every receiver serves
(rollout servers, logp workers) and returns per-part timings in seconds under verl-style
metric names (`timing_s/param_update/<part>`, `async/param_update/blocked_s`). The
pipeline's implementation is `param_update.overlapped.OverlappedWeightSync`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod


class WeightSyncError(RuntimeError):
    """A version could not be delivered; every receiver keeps serving the previous one."""


class WeightSync(ABC):
    @abstractmethod
    async def sync(self, version: int, started_at: float) -> dict[str, float]:
        """Deliver `version` to every receiver; `started_at` is the wall time its gather began."""
