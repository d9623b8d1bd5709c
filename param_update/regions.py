"""The shared buffer's handshake: a region is written again only once nothing reads or serves it.

The sender's shared buffer (param_update/shared_buffer.py) has two regions; the param_update
stage hands one out per version (`acquire`, the sender's first question about a version) and
keeps, per region, who uses the version written there:

- the sync of that version, from `acquire` until it is loaded everywhere or dropped (`loaded`,
  `ended`): receivers read it meanwhile;
- every same-node receiver serving it (the dual buffer swaps the staged views in), until that
  receiver loads a later version (`loaded`) or is lost (`drop`); a receiver that copies on load
  never holds a region past its sync;
- the newest version kept for restarted servers (`retain`).

So with the dual buffer version v gets a region once every receiver has loaded v - 1 (v - 2 is
released everywhere); a failed sync frees its region at once, and v - 1 keeps serving from the other.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Optional

from param_update.interface import WeightSyncError

SYNC = "<sync>"  # the version's own sync holds its region
RETAINED = "<retained>"  # the newest version, kept for restarted servers

REGIONS = 2  # serving and arriving


class RegionLedger:
    """Which version each region holds and who uses it (receiver names, SYNC, RETAINED). One event loop."""

    def __init__(self, regions: int = REGIONS):
        self.versions: list[Optional[int]] = [None] * regions
        self.users: list[set[str]] = [set() for _ in range(regions)]
        self._freed = asyncio.Event()

    def region_of(self, version: int) -> Optional[int]:
        return self.versions.index(version) if version in self.versions else None

    async def acquire(self, version: int, timeout_s: float) -> int:
        """A region nobody uses, now holding `version` (waits up to `timeout_s` s for one to be freed)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not (free := [r for r, users in enumerate(self.users) if not users]):
            self._freed.clear()
            try:
                await asyncio.wait_for(self._freed.wait(), max(deadline - loop.time(), 0.0))
            except asyncio.TimeoutError:
                raise WeightSyncError(f"no shared-memory region free for version {version} after {timeout_s:g} s: "
                                      f"{self.describe()}") from None
        self.versions[free[0]], self.users[free[0]] = version, {SYNC}
        return free[0]

    def loaded(self, version: int, names: Iterable[str], keeping: Iterable[str]) -> None:
        """`names` loaded `version` (its sync is over); those in `keeping` serve it from its region."""
        for name in names:
            self._remove(name)
        region = self.region_of(version)
        if region is not None:
            self.users[region].update(keeping)
        self.ended(version)

    def ended(self, version: int) -> None:
        """The sync of `version` is over (loaded, or dropped everywhere)."""
        region = self.region_of(version)
        if region is not None:
            self.users[region].discard(SYNC)
            self._freed.set()

    def retain(self, version: int) -> None:
        """Keep `version`'s region intact (restarted servers load from it) instead of the previous one's."""
        self._remove(RETAINED)
        region = self.region_of(version)
        if region is not None:
            self.users[region].add(RETAINED)

    def drop(self, name: str) -> None:
        """Receiver `name` is gone: it serves nothing."""
        self._remove(name)

    def _remove(self, user: str) -> None:
        for users in self.users:
            users.discard(user)
        self._freed.set()

    def describe(self) -> str:
        return "; ".join(f"region {r}: version {v}, used by {sorted(u)}"
                         for r, (v, u) in enumerate(zip(self.versions, self.users)))
