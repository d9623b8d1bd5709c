"""verl's `skip.rollout` under the flag: a training batch's agent-loop output dumped to, and replayed from,
verl's own dump directory through verl's `RolloutSkip` (its layout and file format:
`dump_dir/{experiment_name}_{project_name}/GBS{batch}_N{n}_in{prompt}_out{response}/{step}/gen_batch.dp`).

As in verl's trainer: only the global steps listed in `skip.rollout.steps` (from 1) are dumped or replayed,
validation never; `action=cache` replays a step whose dump exists and otherwise generates and dumps it,
`action=repeat` replays the nearest dumped step. The prompt batch of index `i` (from 0) is step `i + 1`: the
step it trains, or with dynamic sampling, which draws more batches than steps, its number among the batches.
A replayed batch's tokens count as generated at the version served when it is replayed, as verl's trainer
counts a replayed batch as its step's own. A dump is read with verl's `DataProto.load_from_disk`, which
unpickles: replay only dumps you wrote.
"""

from __future__ import annotations

from typing import Optional

from omegaconf import DictConfig, OmegaConf

from async_rl.core.errors import AsyncConfigError
from async_rl.rollout.agent_loops import VERSIONS_FIELD

SECTION = "skip.rollout"


class RolloutDumps:
    """verl's `RolloutSkip` for the generate stage: `replayed(step)` before generating, `dump(step, output)` after."""

    def __init__(self, skip):
        self._skip = skip  # verl.utils.skip.RolloutSkip

    @classmethod
    def from_config(cls, config: DictConfig) -> Optional[RolloutDumps]:
        """None unless `skip.rollout.enable`; raises AsyncConfigError naming the key verl's config class refuses."""
        if not OmegaConf.select(config, f"{SECTION}.enable", default=False):
            return None
        section = OmegaConf.select(config, SECTION)
        from verl.utils.config import omega_conf_to_dataclass
        from verl.utils.skip import RolloutSkip
        from verl.utils.skip.config import RolloutSkipConfig

        try:
            local = omega_conf_to_dataclass(section, dataclass_type=RolloutSkipConfig)
        except (AssertionError, TypeError, ValueError) as error:
            raise AsyncConfigError(SECTION, OmegaConf.to_container(section), f"verl's RolloutSkipConfig: {error}") from None
        return cls(RolloutSkip(local, config))

    def replayed(self, step: int):
        """The dumped agent-loop output (a verl DataProto) to train `step` on, or None: `step` is not listed, or
        (`cache`) has no dump yet. Its recorded token versions and agent-loop timings are dropped."""
        if step not in self._skip.steps or not self._skip.meet_precondition(step, None):
            return None
        output = self._skip.warp_function(step, None)
        output.non_tensor_batch.pop(VERSIONS_FIELD, None)
        output.meta_info.pop("metrics", None)  # the dumping run's per-trajectory times: nothing was generated
        return output

    def dump(self, step: int, output) -> None:
        """Write `output` (the agent loop's DataProto for `step`) where `replayed` reads it, if `step` is listed."""
        if step in self._skip.steps:
            self._skip.prepare_data(step, output)
