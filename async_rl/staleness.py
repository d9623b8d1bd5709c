"""AReaL's staleness rule at batch granularity.

Batch `j` (0-based) is trained by the update that turns policy version `j` into `j + 1`.
Its generation may start only once the rollout serves a version `v` with
`j <= v + eta` (AReaL: floor((N_r - 1) / B) <= i + eta, with N_r the trajectories
submitted including this batch's, B the batch size and i the served version). Every
token of batch `j` is then produced by a version >= j - eta, so the staleness of any
trained sample, trainer version `j` minus the oldest version among its tokens, is at
most eta. eta = generate_ahead_steps - 1: k = 1 is synchronous on-policy.
"""

from __future__ import annotations

import asyncio


def may_start_batch(batch_index: int, served_version: int, max_staleness: int) -> bool:
    """AReaL's admission test for batch `batch_index` given the served policy version."""
    return batch_index <= served_version + max_staleness


def sample_staleness(trainer_version: int, oldest_token_version: int) -> int:
    """Versions between the trainer at the update and the oldest version in the sample."""
    return trainer_version - oldest_token_version


class StalenessController:
    """Admits generation of batches under AReaL's rule; tracks the served version.

    Args:
        max_staleness: eta, in policy versions.
        initial_version: version the rollout serves at start (0: the initial weights).
    """

    def __init__(self, max_staleness: int, initial_version: int = 0):
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self.max_staleness = max_staleness
        self.served_version = initial_version
        self._changed: asyncio.Condition | None = None

    @property
    def _condition(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    def may_start(self, batch_index: int) -> bool:
        return may_start_batch(batch_index, self.served_version, self.max_staleness)

    async def wait_until_admitted(self, batch_index: int) -> None:
        """Wait until batch `batch_index` may start generating."""
        async with self._condition:
            await self._condition.wait_for(lambda: self.may_start(batch_index))

    async def set_served_version(self, version: int) -> None:
        """Record a newly loaded version (versions never go back)."""
        async with self._condition:
            if version < self.served_version:
                raise ValueError(f"served version went back from {self.served_version} to {version}")
            self.served_version = version
            self._condition.notify_all()
