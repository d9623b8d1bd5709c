"""Shared fixtures: the demo task built once per session, and running verl's command on it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory) -> Path:
    """A prepared demo (tiny model, tokenizer, data, reward.py, overrides.txt)."""
    from async_rl.demo import prepare

    root = tmp_path_factory.mktemp("demo")
    prepare(root, seed=0, train_size=1024, val_size=32)
    return root


def load_bench(name: str):
    """`bench/<name>.py` as a module (by file: `bench/param_update.py` would shadow the `param_update` package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"bench_{name}", Path(__file__).parents[1] / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compose_ppo(overrides):
    """Compose verl's ppo_trainer config (as `main_ppo` does); unknown keys raise."""
    import verl
    from hydra import compose, initialize_config_dir

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose("ppo_trainer", overrides=list(overrides))


def run_verl(demo_dir: Path, extra, workdir: Path, timeout_s: float = 600) -> tuple[int, str, list[dict]]:
    """`python -m verl.trainer.main_ppo <demo overrides + extra>`; returns (exit code, output, JSONL rows)."""
    from async_rl.demo import demo_overrides

    metrics_path = workdir / "metrics.jsonl"
    env = {**os.environ, "VERL_FILE_LOGGER_PATH": str(metrics_path), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *demo_overrides(demo_dir, extra=extra)]
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout_s)
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines()] if metrics_path.exists() else []
    return proc.returncode, proc.stdout + proc.stderr, rows


def step_rows(rows: list[dict]) -> dict[int, dict]:
    """Training-step metrics by step (rows carrying `training/global_step`)."""
    return {r["step"]: r["data"] for r in rows if "training/global_step" in r["data"]}


def val_rows(rows: list[dict]) -> dict[int, dict]:
    return {r["step"]: r["data"] for r in rows if any(k.startswith("val-core/") for k in r["data"])}
