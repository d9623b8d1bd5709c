"""actor_train stage: joins reward, logp and ref_logp per step, trains, sends the new weights.

For step j it waits for the three results of batch j (in order), computes the proximal
log-probs on its own ranks when the logp stage did not (`algorithm.proximal_logp_workers=train`:
the weights are version j, just before the update, as verl's synchronous trainer and
AReaL's trainer do), builds verl's training batch as verl's trainer does (token-level
scores on the last response token, less verl's KL penalty with `algorithm.use_kl_in_reward`;
verl's rollout correction, which under decoupled PPO weights each token by pi_prox /
pi_behav (async_rl/core/decoupled_ppo.py); advantages through verl's `compute_advantage`: GRPO
and every other estimator verl has; GAE with the values stage's values, and the rows with their
`returns` go to critic_train before the actor's own update), balances it over the
data-parallel ranks (`trainer.balance_batch`), runs verl's `update_actor` on the train
worker group, then gathers version j + 1 into buckets that the workers' send thread
streams to param_update (param_update/sender.py); the next step starts as soon as the
gather is done. Step metrics use verl's names (`compute_data_metrics`, `actor/*`) plus
`async/*`.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any, Optional

import numpy as np
import torch

from async_rl.core.balance import balance_rows
from async_rl.core.decoupled_ppo import add_correction, recomputes_proximal, set_behaviour_as_old
from async_rl.core.devices import world_size_of
from async_rl.core.fault_points import hold_at
from async_rl.core.generation_dumps import GenerationDumps
from async_rl.core.messages import (
    AGENT_LOOP_TIMINGS,
    TOOL_POOL_WAIT,
    TURNS_INTERRUPTED,
    CriticBatch,
    LogpResult,
    NewWeights,
    ScoredBatch,
    TrainingBatch,
    ValuesResult,
    resolve,
    response_lengths,
)
from async_rl.core.policy_clock import ClockRef
from async_rl.core.prompts import model_tokenizer
from async_rl.core.stage_table import JOIN_PARTS
from async_rl.core.staleness import version_metrics
from async_rl.training import engine_calls
from async_rl.training.profiling import ProfiledSteps, ProfileWindows
from async_rl.training.worker_groups import make_worker_group
from state_machines.base import END_OF_STREAM, StateMachine, call_put

def step_part(item) -> tuple[str, Any]:
    """(part name, part) of an upstream output (the stage table's `joins`, async_rl/core/stage_table.py);
    a formed training batch carries the reward part."""
    return JOIN_PARTS[type(item)], item.scored if isinstance(item, TrainingBatch) else item


RANKS_TRACK = "train ranks"  # the timeline track of what the stage has its train ranks do


def place_scores_on_last_token(scores: torch.Tensor, lengths: torch.Tensor, width: int) -> torch.Tensor:
    """Sequence scores (bs,) -> token-level scores (bs, width), on each response's last token (`lengths`:
    `response_lengths`, tool tokens of a multi-turn trajectory included, as verl's reward managers place it)."""
    token_scores = torch.zeros((len(scores), width), dtype=torch.float32)
    last = (lengths - 1).clamp(min=0).long()
    has_tokens = lengths > 0
    rows = torch.arange(len(scores))[has_tokens]
    token_scores[rows, last[has_tokens]] = scores[has_tokens]
    return token_scores


def add_token_level_rewards(batch, kl_ctrl, kl_penalty: str) -> dict[str, float]:
    """verl's `token_level_rewards` from `token_level_scores`: with `algorithm.use_kl_in_reward`
    (`kl_ctrl` given), minus beta * KL(pi_old || pi_ref) on every response token, through verl's
    `apply_kl_penalty` (the controller keeps beta from step to step); otherwise the scores.
    Returns verl's KL metrics (`actor/reward_kl_penalty`, `actor/reward_kl_penalty_coeff`)."""
    if kl_ctrl is None:
        batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
        return {}
    from verl.trainer.ppo.ray_trainer import apply_kl_penalty

    _, metrics = apply_kl_penalty(batch, kl_ctrl=kl_ctrl, kl_penalty=kl_penalty)
    return {k: float(v) for k, v in metrics.items()}


def trainable_rows(kept: int, mini_batch_rows: int, dp_size: int, group_size: int) -> int:
    """Rows of a filtered batch that verl's update can take: whole mini-batches, or one
    smaller mini-batch of whole groups that splits evenly over the data-parallel ranks."""
    if kept >= mini_batch_rows:
        return kept - kept % mini_batch_rows
    unit = math.lcm(group_size, dp_size)
    return kept - kept % unit


def agent_loop_timings(non_tensor_batch: dict) -> dict[str, float]:
    """verl's `agent_loop/{generate_sequences,tool_calls}/{min,max,mean}` (seconds a trajectory) and
    `async/tool_pool/wait_s/{mean,max}` (seconds a trajectory's tool calls waited for an environment) over
    the batch's trajectories; {} for a batch without the columns."""
    metrics = {}
    if TOOL_POOL_WAIT in non_tensor_batch:
        waits = non_tensor_batch[TOOL_POOL_WAIT].astype(np.float64)
        metrics.update({"async/tool_pool/wait_s/mean": float(waits.mean()),
                        "async/tool_pool/wait_s/max": float(waits.max())})
    for name, column in AGENT_LOOP_TIMINGS.items():
        if column in non_tensor_batch:
            seconds = non_tensor_batch[column].astype(np.float64)
            metrics.update({f"agent_loop/{name}/min": float(seconds.min()),
                            f"agent_loop/{name}/max": float(seconds.max()),
                            f"agent_loop/{name}/mean": float(seconds.mean())})
    return metrics


class ActorTrainStage(StateMachine):
    """verl's actor update, one step per batch, in batch order."""

    def __init__(self, *, config, devices, clock: ClockRef, parts: tuple[str, ...], weight_sink=None,
                 bucket_bytes: int = 512 << 20, compute_proximal: bool = False, start_step: int = 0, checkpointer=None,
                 kl_coef=None, critic_sink=None):
        """`devices`: the train ranks' devices (an async_rl.core.devices.GroupDevices, or a count placed
        anywhere); `clock`: the policy clock (async_rl/core/policy_clock.py): its gate checks each step's
        staleness, and each step's version is published to it; `parts`: the parts a step joins (names of
        the stage table's `joins`: reward, logp, ref_logp, values with a critic); `weight_sink`: the
        param_update stage handle; `bucket_bytes`: the gather's bucket size; `compute_proximal`: recompute
        old_log_probs here, before each update (the logp stage does not); `start_step`: the version a resumed
        run starts from; `checkpointer`: async_rl.checkpoints.RunCheckpointer (None: no checkpoints);
        `kl_coef`: the KL-in-reward coefficient to resume with; `critic_sink`: the critic_train stage (None:
        no critic)."""
        super().__init__("actor_train", inbox_size=6)
        self.config = config
        self.devices = devices
        self.world_size = world_size_of(devices)
        self.gate, self.policy_clock = clock.gate, clock.handle
        self.weight_sink = weight_sink
        self.bucket_bytes = bucket_bytes
        self.compute_proximal = compute_proximal
        self.temperature = float(config.actor_rollout_ref.rollout.temperature)
        self.kl_ctrl_in_reward = None  # verl's KL controller, kept across steps (algorithm.use_kl_in_reward)
        if config.algorithm.get("use_kl_in_reward", False):
            from verl.trainer.ppo.core_algos import get_kl_controller

            self.kl_ctrl_in_reward = get_kl_controller(config.algorithm.kl_ctrl)
            if kl_coef is not None:
                self.kl_ctrl_in_reward.value = kl_coef
        self.worker_group = None
        self.profile = ProfileWindows(None, ProfiledSteps())  # verl's profiler windows, set up with the workers
        self.version = start_step  # trainer's policy version: number of updates done
        self.checkpointer = checkpointer
        self.critic_sink = critic_sink
        self.parts_needed = len(parts)
        self.critic_warmup = int(config.trainer.get("critic_warmup", 0) or 0) if critic_sink is not None else 0
        self.dumps = GenerationDumps(config.trainer.get("rollout_data_dir"))
        self._tokenizer = None
        self._step_lock = asyncio.Lock()  # held for a whole training step
        self._stopping = False
        self._parts: dict[int, dict[str, Any]] = {}
        self._metrics: list[dict] = []
        self._last_step_end = None
        self._max_step_s = 0.0  # the longest step so far (s): verl's max_steps_duration, for the ESI save

    def setup(self) -> int:
        self.worker_group = make_worker_group(self.config, "actor", self.devices, "train", trains=True)
        self.profile = ProfileWindows(self.worker_group, ProfiledSteps.from_config(self.config), role="train")
        return self.world_size

    def weight_digests(self) -> dict[str, str]:
        """name -> digest of the full weights this stage's workers hold (bit-identity checks)."""
        return self.worker_group.weight_digests()[0]

    def load_checkpoint(self, path: str, del_local_after_load: bool = False) -> int:
        """verl's load_checkpoint of `path`/actor into the train ranks (model, optimizer, lr scheduler, RNG)."""
        import os

        self.worker_group.load_checkpoint(os.path.join(path, "actor"), None, del_local_after_load)
        return self.version

    async def send_weights(self) -> None:
        """Send the current version to the receivers (a resumed run, before anything generates)."""
        await asyncio.to_thread(self.worker_group.send_weight_buckets, self.version, self.bucket_bytes,
                                self.weight_sink)

    async def close_weight_sender(self) -> None:
        """Unlink the weight send's shared-memory files (the pipeline's shutdown)."""
        if self.worker_group is not None:
            await asyncio.to_thread(self.worker_group.close_weight_sender)

    async def checkpoint_and_stop(self) -> Optional[int]:
        """Train no further step: let the running one finish, save the last completed step (if
        checkpoints are on and it is not saved yet), wait for every write; the newest saved step."""
        self._stopping = True
        async with self._step_lock:
            if self.checkpointer is None:
                return None
            if self.checkpointer.last_saved != self.version and self._last_step_end is not None:
                self.dumps.flush()
                await self.checkpointer.save(self.version, self.worker_group, self._kl_coef())
            return await self.checkpointer.wait()

    def _kl_coef(self) -> Optional[float]:
        return None if self.kl_ctrl_in_reward is None else float(self.kl_ctrl_in_reward.value)

    def _dump_rollouts(self, step: int, batch) -> None:
        """verl's trainer.rollout_data_dir dump of the rows step `step` trained."""
        if self.dumps.directory is None:
            return
        if self._tokenizer is None:
            self._tokenizer = model_tokenizer(self.config)
        self.dumps.write_batch(step, batch, self._tokenizer, batch.batch["token_level_scores"].sum(-1).tolist())

    def weight_layout(self) -> tuple[dict, Any]:
        """(name -> (dtype, shape) of what this stage sends, the LoRA adapter the receivers merge or None):
        param_update sets the receivers up for them (param_update/lora.py)."""
        return self.worker_group.weight_layout()[0], self.worker_group.lora_adapter()[0]

    async def get_input_data(self):
        want = self.version  # batch j is trained at trainer version j
        while len(self._parts.get(want, {})) < self.parts_needed:
            item = await self.next_from_inbox()
            if item is END_OF_STREAM:
                if self._parts:
                    raise RuntimeError(f"upstreams ended with incomplete steps {sorted(self._parts)}")
                return END_OF_STREAM
            name, part = step_part(item)
            self._parts.setdefault(item.index, {})[name] = part
        return self._parts.pop(want)

    def _training_batch(self, batch, parts) -> tuple[Any, dict]:
        """verl's training batch, as its trainer builds it, and the KL-penalty and rollout-correction metrics."""
        from verl.trainer.ppo.ray_trainer import compute_advantage

        algo = self.config.algorithm
        batch.batch["token_level_scores"] = place_scores_on_last_token(
            parts["reward"].scores, response_lengths(batch), batch.batch["responses"].shape[1])
        if parts["logp"].old_log_probs is not None:
            batch.batch["old_log_probs"] = parts["logp"].old_log_probs
        if parts["ref_logp"].ref_log_prob is not None:
            batch.batch["ref_log_prob"] = parts["ref_logp"].ref_log_prob
        if "values" in parts:
            batch.batch["values"] = parts["values"].values
        if parts["reward"].baselines is not None:  # ReMax's greedy-sample scores (verl's reward_baselines)
            batch.batch["reward_baselines"] = parts["reward"].baselines
        set_behaviour_as_old(batch, self.config, self.version)
        kl_metrics = add_token_level_rewards(batch, self.kl_ctrl_in_reward, algo.get("kl_penalty", "kl"))
        batch, correction_metrics = add_correction(batch, self.config)
        return compute_advantage(
            batch,
            adv_estimator=algo.adv_estimator,
            gamma=algo.gamma,
            lam=algo.lam,
            num_repeat=int(self.config.actor_rollout_ref.rollout.n),
            norm_adv_by_std_in_grpo=algo.get("norm_adv_by_std_in_grpo", True),
            config=algo,
        ), {**kl_metrics, **correction_metrics}

    def _rows_to_train(self, scored: ScoredBatch, num_rows: int) -> np.ndarray:
        """Row indices to train on: the rows a filter stage kept, trimmed to what verl's update takes."""
        keep = np.arange(num_rows) if scored.keep is None else np.flatnonzero(scored.keep.numpy())
        actor_rollout_ref = self.config.actor_rollout_ref
        n = int(actor_rollout_ref.rollout.n)
        mini = int(actor_rollout_ref.actor.ppo_mini_batch_size) * n
        return keep[: trainable_rows(len(keep), mini, self.world_size, n)]

    def _version_metrics(self, batch) -> dict[str, float]:
        metrics = version_metrics(
            batch.batch["token_versions"], batch.batch["response_mask"], batch.non_tensor_batch["start_version"],
            self.version, self.gate.max_staleness,
        )
        if TURNS_INTERRUPTED in batch.non_tensor_batch:  # agent loops: turns a weight load split, per trajectory
            metrics["async/partial/turns_interrupted"] = float(np.mean(
                batch.non_tensor_batch[TURNS_INTERRUPTED].astype(np.float64)))
        metrics.update(agent_loop_timings(batch.non_tensor_batch))
        self.gate.check_trained(self.version, metrics["async/staleness/max"])
        return metrics

    def _check_proximal_version(self, logp) -> None:
        """pi_prox must be the trainer's pre-update policy (a scheduling bug otherwise)."""
        if recomputes_proximal(self.config) and logp.logp_version != self.version:
            raise RuntimeError(
                f"step {self.version}: the logp stage computed old_log_probs with version {logp.logp_version}, "
                f"the trainer is at {self.version}"
            )

    async def _proximal_log_probs(self, logp: LogpResult, batch) -> tuple[LogpResult, float]:
        """pi_prox of `batch` on the train ranks, with the pre-update weights (version `self.version`); seconds."""
        start = time.perf_counter()
        with self.trace.span(RANKS_TRACK, "pi_prox", step=self.version + 1):
            log_probs = await asyncio.to_thread(engine_calls.compute_log_prob, self.worker_group, batch,
                                                self.temperature)
        result = LogpResult(index=logp.index, batch_ref=logp.batch_ref, old_log_probs=log_probs,
                            logp_version=self.version)
        return result, time.perf_counter() - start

    def trace_args(self, data: Any) -> dict:
        """The batch's index, and the trainer's version it trains from (not the version it was generated at)."""
        return {**super().trace_args(data), "version": self.version}

    async def process_data(self, parts: dict) -> None:
        if self._stopping:  # checkpoint_and_stop: the driver stops the run; train nothing more
            await asyncio.Event().wait()
        async with self._step_lock, self.profile.window(self.version + 1):  # verl's profilers: pi_prox, update
            await self._train_step(parts)

    async def _train_step(self, parts: dict) -> None:
        from verl.trainer.ppo.metric_utils import compute_data_metrics

        if self.checkpointer is not None:
            self.checkpointer.raise_if_failed()
        step_start = time.perf_counter()
        batch = await resolve(parts["logp"].batch_ref)
        old_log_prob_s = None
        if self.compute_proximal:  # stamped with this trainer's version: nothing to check
            parts["logp"], old_log_prob_s = await self._proximal_log_probs(parts["logp"], batch)
        else:
            self._check_proximal_version(parts["logp"])
        batch, algorithm_metrics = self._training_batch(batch, parts)
        rows = self._rows_to_train(parts["reward"], len(batch))
        train_batch = batch if len(rows) == len(batch) else batch.select_idxs(rows)
        metrics = {**parts["reward"].metrics, **algorithm_metrics}
        metrics.update(self._version_metrics(train_batch if len(rows) else batch))
        if len(rows) and self.config.trainer.get("balance_batch", True):
            metrics.update(balance_rows(train_batch, self.world_size, by_group=bool(
                self.config.actor_rollout_ref.actor.get("use_prefix_grouper", False))))
        metrics["async/logp_version"] = float(parts["logp"].logp_version)
        metrics["async/trained_rows"] = float(len(rows))
        if old_log_prob_s is not None:
            metrics["timing_s/old_log_prob"] = old_log_prob_s  # verl's name for this forward
        if self.critic_sink is not None:
            await self._send_to_critic(train_batch, len(rows), parts["values"], metrics)
        t0 = time.perf_counter()
        # a step whose rows were all filtered out makes no update, nor does one in verl's critic warmup
        # (global step version + 1 < trainer.critic_warmup); its version carries the same weights
        if len(rows) and self.version + 1 >= self.critic_warmup:
            with self.trace.span(RANKS_TRACK, "update", step=self.version + 1):
                metrics.update(
                    await asyncio.to_thread(
                        engine_calls.update_actor, self.worker_group, train_batch, self.config.actor_rollout_ref,
                        self.config.get("distillation")
                    )
                )
        t1 = time.perf_counter()
        await asyncio.to_thread(hold_at, "train_step", self.version + 1)  # held as a hung worker call holds
        # announce the version first: param_update stages its buckets while the gather still runs
        await self.send_downstream(NewWeights(version=self.version + 1, started_at=time.time()))
        with self.trace.span(RANKS_TRACK, "gather and send", version=self.version + 1):
            await asyncio.to_thread(
                self.worker_group.send_weight_buckets, self.version + 1, self.bucket_bytes, self.weight_sink
            )
        t2 = time.perf_counter()
        self.version += 1
        await self.policy_clock.set_trained_version.remote(self.version)
        self._dump_rollouts(self.version, train_batch)
        if self.checkpointer is not None:
            if self.checkpointer.due(self.version, self._max_step_s):
                self.dumps.flush()  # every dump of a saved step is on disk with it
                with self.trace.span(RANKS_TRACK, "checkpoint snapshot", step=self.version):
                    metrics.update(await self.checkpointer.save(self.version, self.worker_group, self._kl_coef()))
            metrics.update(self.checkpointer.pop_written())  # the newest write committed beside training
        data_metrics = compute_data_metrics(batch, use_critic=self.critic_sink is not None)
        metrics.update({k: float(v) for k, v in data_metrics.items()})  # `num_turns/*` are numpy ints; JSON wants floats
        now = time.perf_counter()
        metrics.update(
            {
                "training/global_step": self.version,
                "async/param_version": float(self.version),
                "timing_s/update_actor": t1 - t0,
                "timing_s/gather_weights": t2 - t1,  # training waits this long for the weight sync
                "timing_s/step": now - (self._last_step_end if self._last_step_end is not None else step_start),
            }
        )
        self._max_step_s = max(self._max_step_s, metrics["timing_s/step"])
        self._last_step_end = now
        self._metrics.append(metrics)  # nothing returned: NewWeights already went downstream

    async def _send_to_critic(self, train_batch, num_rows: int, values: ValuesResult, metrics: dict) -> None:
        """Hand the step's rows, with their values and returns, to critic_train (it trains beside the
        actor's update); a step with no rows sends an empty batch, so the critic's version still counts steps."""
        import ray

        if values.critic_version != self.version:
            raise RuntimeError(f"step {self.version}: values from critic version {values.critic_version}")
        metrics["async/critic_version"] = float(values.critic_version)
        metrics["timing_s/values"] = values.seconds  # verl's name for the critic's forward
        rows = train_batch if num_rows else None
        ref = ray.put(rows) if ray.is_initialized() else rows
        await call_put(self.critic_sink, CriticBatch(index=self.version, batch_ref=ref))

    async def on_end(self) -> None:
        """The last checkpoint and rollout dumps are on disk before the stage ends."""
        if self.critic_sink is not None:
            await call_put(self.critic_sink, END_OF_STREAM)
        if self.checkpointer is not None:
            await self.checkpointer.wait()
        self.dumps.flush()

    def pop_metrics(self) -> list[dict]:
        out, self._metrics = self._metrics, []
        return out
