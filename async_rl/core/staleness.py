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
        await self.wait_until(lambda: self.may_start(batch_index))

    async def wait_until(self, ready) -> None:
        """Wait until `ready()` holds; checked again at each version change and `notify()`."""
        async with self._condition:
            await self._condition.wait_for(ready)

    async def notify(self) -> None:
        """Wake the waiters to check their condition again (something else they read changed)."""
        async with self._condition:
            self._condition.notify_all()

    async def set_served_version(self, version: int) -> None:
        """Record a newly loaded version (versions never go back)."""
        async with self._condition:
            if version < self.served_version:
                raise ValueError(f"served version went back from {self.served_version} to {version}")
            self.served_version = version
            self._condition.notify_all()


def oldest_versions(token_versions, response_mask, start_versions):
    """(bs,) long tensor: the oldest version among each row's response tokens (its admission
    version, `start_versions[i]`, if it has none). Tensors: (bs, resp_len)."""
    import torch

    big = torch.iinfo(torch.long).max
    oldest = torch.where(response_mask.bool(), token_versions, torch.full_like(token_versions, big)).min(dim=-1).values
    start = torch.as_tensor([int(v) for v in start_versions], dtype=torch.long)
    return torch.where(oldest == big, start, oldest)


def version_metrics(
    token_versions, response_mask, start_versions, trainer_version: int, max_staleness: int
) -> dict[str, float]:
    """Staleness and partial-rollout metrics of a training batch (tensors: (bs, resp_len)).

    A sample's staleness is the trainer version minus the oldest version among its tokens
    (its admission version if it has none). `async/staleness/hist_<s>` is the fraction of
    samples with staleness s (0..eta); `async/partial/ratio` the fraction whose tokens come
    from more than one version (interrupted by a load), `async/partial/max_versions_spanned`
    the most versions in one sample.
    """
    import torch

    mask = response_mask.bool()
    oldest = oldest_versions(token_versions, response_mask, start_versions)
    staleness = torch.tensor([sample_staleness(trainer_version, int(v)) for v in oldest])
    spanned = torch.tensor([len(set(token_versions[i][mask[i]].tolist())) for i in range(len(mask))])
    metrics = {
        "async/staleness/max": float(staleness.max()),
        "async/staleness/mean": float(staleness.float().mean()),
        "async/partial/ratio": float((spanned > 1).float().mean()),
        "async/partial/max_versions_spanned": float(spanned.max()),
    }
    for s in range(max(max_staleness, int(staleness.max())) + 1):
        metrics[f"async/staleness/hist_{s}"] = float((staleness == s).float().mean())
    return metrics
