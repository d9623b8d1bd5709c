"""dynamic_sampling stage: DAPO's dynamic sampling, drawing until the batch is full.

With verl's `algorithm.filter_groups.enable=True` the graph becomes

    rollout -> reward -> dynamic_sampling -> logp, ref_logp, actor_train

The stage keeps the prompt groups whose rewards differ (verl's rule, a one-sample group is
kept), pools them across generated batches, and emits training batch j once it holds
`data.train_batch_size` groups: the oldest first (by the oldest policy version among their
tokens), never one older than eta at step j (such a group is dropped). Generation goes on
meanwhile: the generate stage admits prompt batches while the next training batch to form,
j, satisfies j <= served version + eta (each batch formed is published to the policy clock,
async_rl/core/policy_clock.py), so a filtered-out batch is
replaced by drawing more prompts. verl's `max_num_gen_batches` (> 0) bounds the batches drawn
for one training batch; past it the run fails with a message saying so. The logp stage then
computes pi_prox for exactly the rows trained (with version j).

Checkpoints (async_rl/checkpoints.py) save, for step N, the pool as it was right after batch
N - 1 was formed and how many generated batches had been drawn by then (`checkpoint_state`):
a resume restores the pool and draws again from the batch after those.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import ray
import torch

from async_rl.core.messages import ScoredBatch, TrainingBatch, resolve
from async_rl.core.policy_clock import ClockRef
from async_rl.core.plain_data import rows_from_plain, rows_to_plain
from async_rl.core.scoring import groups_with_distinct_rewards
from async_rl.core.staleness import oldest_versions
from state_machines.base import END_OF_STREAM, StateMachine
from state_machines.reward import REMAX_BASELINE_METRIC


@dataclass
class _Group:
    arrival: int  # order in which groups arrived (ties between equally old groups)
    oldest_version: int  # the oldest policy version among its tokens
    uid: str
    rows: Any  # DataProto of the group's samples
    scores: torch.Tensor
    baselines: Optional[torch.Tensor] = None  # ReMax: the greedy sample's score, per row


class DynamicSamplingStage(StateMachine):
    """Pools groups with distinct rewards into full training batches, oldest first, within eta.

    Args:
        config: the verl config (`data.train_batch_size`, `algorithm.filter_groups`).
        clock: the policy clock (async_rl/core/policy_clock.py): its gate drops groups past the bound, and
            each training batch formed is published to it (generation is admitted against it).
        total_steps: training batches to form; later input is dropped.
        dataloader: the dataloader stage's handle, asked to stop once the last batch is formed (None in tests).
        start_step, generated_batches, pool: where a resumed run starts (`checkpoint_state`).
    """

    def __init__(self, *, config, clock: ClockRef, total_steps: int, dataloader=None, start_step: int = 0,
                 generated_batches: int = 0, pool: Optional[list] = None):
        super().__init__("dynamic_sampling", inbox_size=2)
        self.batch_groups = int(config.data.train_batch_size)
        self.max_gen_batches = int(config.algorithm.filter_groups.get("max_num_gen_batches") or 0)
        self.gate, self.policy_clock = clock.gate, clock.handle
        self.total_steps = total_steps
        self.dataloader = dataloader
        self.pending: list[_Group] = [_Group(**{**g, "rows": rows_from_plain(g["rows"])}) for g in pool or ()]
        self.step = start_step  # the next training batch to form
        self.generated = generated_batches  # generated batches drawn so far
        self._arrivals = max((g.arrival for g in self.pending), default=-1) + 1
        self._drawn = 0  # generated batches drawn for the batch being formed
        self._reward_errors = 0.0  # samples the reward stage scored 0 (reward.on_error=zero) in those batches
        self._counts = {"groups": 0, "kept": 0, "dropped_stale": 0}
        self._snapshots: dict[int, tuple[int, list[_Group]]] = {}  # steps formed -> (generated, pool)

    async def get_input_data(self):
        item = await self.next_from_inbox()
        if item is END_OF_STREAM and self.step < self.total_steps:
            raise RuntimeError(
                f"generation ended with {self.step} of {self.total_steps} training batches formed "
                f"({len(self.pending)} groups with distinct rewards pending)"
            )
        return item

    async def process_data(self, scored: ScoredBatch) -> Optional[TrainingBatch]:
        if self.step >= self.total_steps:
            return None  # generated ahead while the last batches trained: not needed
        self._drawn += 1
        self.generated += 1
        self._reward_errors += scored.metrics.get("async/faults/reward_errors", 0.0)
        batch = await resolve(scored.batch_ref)
        self._pool(batch, scored)
        self._drop_stale()
        if len(self.pending) < self.batch_groups:
            if self.max_gen_batches and self._drawn >= self.max_gen_batches:
                raise RuntimeError(
                    f"training batch {self.step}: {self._drawn} generated batches gave {len(self.pending)} of "
                    f"{self.batch_groups} prompt groups whose rewards differ "
                    f"(algorithm.filter_groups.max_num_gen_batches={self.max_gen_batches}); the task is too easy "
                    "or too hard for the policy, or raise the bound (0 = none)"
                )
            return None
        return await self._emit()

    def _pool(self, batch, scored: ScoredBatch) -> None:
        keep = groups_with_distinct_rewards(scored.uids, scored.scores).numpy()
        oldest = oldest_versions(
            batch.batch["token_versions"], batch.batch["response_mask"], batch.non_tensor_batch["start_version"]
        ).numpy()
        for uid in dict.fromkeys(scored.uids.tolist()):
            rows = np.flatnonzero(scored.uids == uid)
            self._counts["groups"] += 1
            if not keep[rows[0]]:
                continue
            self._counts["kept"] += 1
            self.pending.append(
                _Group(self._arrivals, int(oldest[rows].min()), uid, batch.select_idxs(rows), scored.scores[rows],
                       None if scored.baselines is None else scored.baselines[rows])
            )
            self._arrivals += 1

    def _drop_stale(self) -> None:
        """Groups that would be older than eta at the step being formed can never be trained."""
        fresh = [g for g in self.pending if self.gate.fresh(self.step, g.oldest_version)]
        self._counts["dropped_stale"] += len(self.pending) - len(fresh)
        self.pending = fresh

    async def _emit(self) -> TrainingBatch:
        from verl import DataProto

        chosen = sorted(self.pending, key=lambda g: (g.oldest_version, g.arrival))[: self.batch_groups]
        taken = {id(g) for g in chosen}
        self.pending = [g for g in self.pending if id(g) not in taken]
        batch = DataProto.concat([g.rows for g in chosen])
        metrics = {
            "async/dynamic_sampling/gen_batches": float(self._drawn),
            "async/dynamic_sampling/kept_ratio": self._counts["kept"] / max(self._counts["groups"], 1),
            "async/dynamic_sampling/dropped_stale_groups": float(self._counts["dropped_stale"]),
            "async/dynamic_sampling/pending_groups": float(len(self.pending)),
            "async/faults/reward_errors": self._reward_errors,
        }
        baselines = None if chosen[0].baselines is None else torch.cat([g.baselines for g in chosen])
        if baselines is not None:  # ReMax: the trained prompts' greedy scores (the reward stage's metric, per batch)
            metrics[REMAX_BASELINE_METRIC] = float(baselines.mean())
        scored = ScoredBatch(
            index=self.step,
            scores=torch.cat([g.scores for g in chosen]),
            uids=np.asarray(batch.non_tensor_batch["uid"]),
            metrics=metrics,
            baselines=baselines,
        )
        ref = ray.put(batch) if ray.is_initialized() else batch
        start = min(int(v) for v in batch.non_tensor_batch["start_version"])
        out = TrainingBatch(index=self.step, batch_ref=ref, start_version=start, scored=scored)
        self.step += 1
        self._drawn, self._reward_errors = 0, 0.0
        self._snapshots[self.step] = (self.generated, list(self.pending))
        await self.policy_clock.set_steps_formed.remote(self.step)
        if self.step == self.total_steps and self.dataloader is not None:
            await self.dataloader.stop_producing.remote()
        return out

    def checkpoint_state(self, step: int) -> tuple[int, list[dict]]:
        """(generated batches drawn, pool) right after training batch `step - 1` was formed: what a
        step-`step` checkpoint saves, each group's rows as plain data (`rows_to_plain`). Earlier
        snapshots are dropped."""
        if step not in self._snapshots:
            raise KeyError(f"no dynamic-sampling snapshot for step {step} (kept: {sorted(self._snapshots)})")
        for old in [s for s in self._snapshots if s < step]:
            del self._snapshots[old]
        generated, pool = self._snapshots[step]
        return generated, [{**vars(g), "rows": rows_to_plain(g.rows)} for g in pool]
