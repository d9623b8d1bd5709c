"""Running verl's command on the demo (`run_verl`, `start_verl`) and the pipeline itself with the weight
digests of every weight holder (`run_pipeline_reading_digests`, `start_pipeline_reading_digests`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers.processes import assert_nothing_left, kill_session, watch_session


def run_verl(demo_dir: Path, extra, workdir: Path, timeout_s: float = 600, critic: bool = False,
             ray_address: str | None = None, agent: bool = False) -> tuple[int, str, list[dict]]:
    """`python -m verl.trainer.main_ppo <demo overrides + extra>` (`critic`: the demo's PPO with GAE; `agent`:
    the lookup task's agent loop), on the Ray cluster at `ray_address` (None: a Ray of its own); returns
    (exit code, output, JSONL rows). With a Ray of its own and the flag on, whether it ended or failed,
    nothing of the run may be left once it has exited (`assert_nothing_left`)."""
    from async_rl.demo import demo_overrides

    workdir.mkdir(parents=True, exist_ok=True)
    metrics_path = workdir / "metrics.jsonl"
    env = {**os.environ, "VERL_FILE_LOGGER_PATH": str(metrics_path), "PYTHONUNBUFFERED": "1",
           **({"RAY_ADDRESS": ray_address} if ray_address else {})}
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *demo_overrides(demo_dir, extra=extra, critic=critic, agent=agent)]
    if ray_address:  # workers of a running cluster do not inherit this process's environment: verl's trainer
        # logs from its TaskRunner actor
        cmd.append(f"+ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH={metrics_path}")
    proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    watch_session(proc)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_session(proc)
        raise
    if ray_address is None and "+actor_rollout_ref.async_pipeline=True" in cmd:
        assert_nothing_left(proc, f"after the run exited ({proc.returncode}):\n{(out + err)[-2000:]}")
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines()] if metrics_path.exists() else []
    return proc.returncode, out + err, rows


DIGESTS_SCRIPT = """
import importlib, json, os, sys
import verl
from hydra import compose, initialize_config_dir
from async_rl.build import weight_digests
from async_rl.demo import demo_overrides
from async_rl.pipeline import run_pipeline
from async_rl.run_config import read_run_config

demo_dir, out_path, extra = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
for module in json.loads(sys.argv[4]):  # e.g. a rollout backend that registers itself on import
    importlib.import_module(module)
with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"),
                           version_base=None):
    config = compose("ppo_trainer", overrides=demo_overrides(demo_dir, extra=extra))
result = {}
history = run_pipeline(read_run_config(config), after_training=lambda built: result.update(weight_digests(built)))
with open(out_path, "w") as f:
    json.dump({"digests": result, "steps": [h for h in history if "training/global_step" in h]}, f)
"""


def run_pipeline_reading_digests(demo_dir: Path, extra: dict, workdir: Path, env=None, timeout_s: float = 900,
                                 imports: tuple = ()) -> tuple[subprocess.CompletedProcess, dict | None]:
    """The pipeline on the demo (`run_pipeline`), then `weight_digests` of every weight
    holder; returns the process and {"digests": holder -> name -> digest, "steps": the step metrics}."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "VERL_FILE_LOGGER_PATH": str(workdir / "metrics.jsonl"),
           **(env or {})}
    proc = subprocess.run(digests_command(demo_dir, extra, workdir, imports),
                          cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout_s)
    return proc, read_digests(workdir)


def digests_command(demo_dir: Path, extra: dict, workdir: Path, imports: tuple = ()) -> list[str]:
    """DIGESTS_SCRIPT's command line, its result written to `workdir`/result.json (`read_digests`)."""
    return [sys.executable, "-c", DIGESTS_SCRIPT, str(demo_dir), str(workdir / "result.json"), json.dumps(extra),
            json.dumps(list(imports))]


def start_pipeline_reading_digests(demo_dir: Path, extra: dict, workdir: Path) -> subprocess.Popen:
    """`run_pipeline_reading_digests` started in its own session, as `start_verl` starts verl's command (its
    output in metrics.jsonl.log, its Ray its own); once it has exited, `read_digests(workdir)` reads its result."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "VERL_FILE_LOGGER_PATH": str(workdir / "metrics.jsonl")}
    env.pop("RAY_ADDRESS", None)
    log = open(workdir / "metrics.jsonl.log", "w")
    proc = subprocess.Popen(digests_command(demo_dir, extra, workdir), cwd=workdir, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    watch_session(proc)
    return proc


def read_digests(workdir: Path) -> dict | None:
    """What `start_pipeline_reading_digests` wrote (as `run_pipeline_reading_digests` returns it), None if nothing."""
    out = workdir / "result.json"
    return json.loads(out.read_text()) if out.exists() else None


def start_verl(demo_dir: Path, extra, workdir: Path, metrics_name: str = "metrics.jsonl", env=None,
               drop: tuple = ()) -> subprocess.Popen:
    """`python -m verl.trainer.main_ppo <demo overrides + extra, less the keys in drop>` in its own session (so
    that `kill_session` reaches every process of the run: the driver, Ray's services, every actor)."""
    from async_rl.demo import demo_overrides

    env = {**os.environ, "VERL_FILE_LOGGER_PATH": str(workdir / metrics_name), "PYTHONUNBUFFERED": "1", **(env or {})}
    overrides = [o for o in demo_overrides(demo_dir, extra=extra) if o.split("=", 1)[0] not in drop]
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *overrides]
    log = open(workdir / f"{metrics_name}.log", "w")
    proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    watch_session(proc)
    return proc
