"""param_update stage: takes each new version from actor_train and syncs it to the receivers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from param_update.interface import WeightSync
from state_machines.base import StateMachine


@dataclass
class NewWeights:
    """A trained version: its full tensors by reference (gathered by actor_train)."""

    version: int
    weights_ref: Any


class ParamUpdateStage(StateMachine):
    """Syncs every new version through a `WeightSync`; keeps the timings for metrics."""

    def __init__(self, weight_sync: WeightSync):
        super().__init__("param_update", inbox_size=1)
        self.weight_sync = weight_sync
        self.synced_version = 0
        self.timings: dict[int, dict[str, float]] = {}

    async def get_input_data(self):
        return await self.next_from_inbox()

    async def process_data(self, data: NewWeights) -> None:
        self.timings[data.version] = await self.weight_sync.sync(data.version, data.weights_ref)
        self.synced_version = data.version
        return None  # nothing flows downstream: receivers are called directly

    async def send_output_data(self, data) -> bool:
        return True

    def pop_timings(self) -> dict[int, dict[str, float]]:
        out, self.timings = self.timings, {}
        return out
