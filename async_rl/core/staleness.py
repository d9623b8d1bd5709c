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

from dataclasses import dataclass


def may_start_batch(batch_index: int, served_version: int, max_staleness: int) -> bool:
    """AReaL's admission test for batch `batch_index` given the served policy version."""
    return batch_index <= served_version + max_staleness


def sample_staleness(trainer_version: int, oldest_token_version: int) -> int:
    """Versions between the trainer at the update and the oldest version in the sample."""
    return trainer_version - oldest_token_version


class StalenessViolation(RuntimeError):
    """A sample older than the bound reached training (a scheduling bug, never expected)."""


@dataclass(frozen=True)
class StalenessGate:
    """The staleness rule with bound eta (`max_staleness`), everywhere the pipeline applies it: the
    generate stage's admission and the batches it holds, the dynamic_sampling stage's pool and
    actor_train's check. The versions it is applied to come from the policy clock
    (async_rl/core/policy_clock.py).

    steps_formed_after_generation: training batches are formed after generation (dynamic sampling,
        `algorithm.filter_groups.enable`), so a prompt batch is admitted against the next training
        batch to form rather than its own index.
    """

    max_staleness: int
    steps_formed_after_generation: bool = False

    def __post_init__(self):
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")

    @property
    def batches_ahead(self) -> int:
        """Prompt batches the generate stage's inbox holds, and generates at once: eta + 1."""
        return self.max_staleness + 1

    def admits(self, batch_index: int, served_version: int, steps_formed: int = 0) -> bool:
        """Whether prompt batch `batch_index` may start generating while `served_version` is served and
        `steps_formed` training batches are formed."""
        step = steps_formed if self.steps_formed_after_generation else batch_index
        return may_start_batch(step, served_version, self.max_staleness)

    def fresh(self, trainer_version: int, oldest_version: int) -> bool:
        """Whether a sample whose oldest token is of `oldest_version` may train at `trainer_version`."""
        return sample_staleness(trainer_version, oldest_version) <= self.max_staleness

    def check_trained(self, trainer_version: int, staleness: float) -> None:
        """StalenessViolation when the stalest sample of step `trainer_version` is past the bound."""
        if staleness > self.max_staleness:
            raise StalenessViolation(
                f"step {trainer_version}: a sample has staleness {staleness:g} > eta={self.max_staleness}")


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
