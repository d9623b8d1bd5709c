"""The weight-sync interface the pipeline calls, and the blocking implementation.

`WeightSync.sync(version, weights_ref)` makes `version` the weights every receiver
serves (rollout servers, logp workers) and returns per-part timings in seconds. This
issue's implementation is blocking: receivers load one after another in full; the
five-part overlapped pipeline with a dual buffer replaces it behind this interface.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod


class WeightSyncError(RuntimeError):
    """A receiver failed to load a version; the previous version keeps serving."""


class WeightSync(ABC):
    @abstractmethod
    async def sync(self, version: int, weights_ref) -> dict[str, float]:
        """Deliver `version` to every receiver; returns `timing_s/param_update/<part>` seconds."""


class BlockingWeightSync(WeightSync):
    """recv + load in full on every receiver, then announce the version to generate.

    Args:
        rollout_servers: verl rollout server handles with `update_weights(named, version)`.
        logp_stage: handle with `load_weights(version, named)`.
        generate_stage: handle with `set_served_version(version)`.
        timeout_s: one receiver's load may take this long.
    """

    def __init__(self, rollout_servers, logp_stage, generate_stage, timeout_s: float = 300.0):
        self.rollout_servers = list(rollout_servers)
        self.logp_stage = logp_stage
        self.generate_stage = generate_stage
        self.timeout_s = timeout_s

    async def sync(self, version: int, weights_ref) -> dict[str, float]:
        t0 = time.perf_counter()
        named = await weights_ref  # recv: one fetch from the object store
        t_recv = time.perf_counter()
        try:
            loads = [s.update_weights.remote(named_tensors=named, version=version) for s in self.rollout_servers]
            loads.append(self.logp_stage.load_weights.remote(version, named))
            await asyncio.wait_for(asyncio.gather(*loads), timeout=self.timeout_s)
        except asyncio.TimeoutError as exc:
            raise WeightSyncError(f"loading version {version} took longer than {self.timeout_s:g} s") from exc
        except Exception as exc:
            raise WeightSyncError(f"loading version {version} failed: {type(exc).__name__}: {exc}") from exc
        t_load = time.perf_counter()
        await self.generate_stage.set_served_version.remote(version)
        return {
            "timing_s/param_update/recv": t_recv - t0,
            "timing_s/param_update/load": t_load - t_recv,
            "timing_s/param_update/total": time.perf_counter() - t0,
        }
