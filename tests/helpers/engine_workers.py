"""A script against verl's real FSDP2 engine workers, run in a fresh process with a Ray of its own
(`run_on_workers`). The script starts after `PREAMBLE`, which gives it the demo's config as verl's trainer
composes it (`demo_config`), its batch (`demo_batch`: `skewed_batch`), `engine_calls`, `make_worker_group`,
and `done(result)`, which shuts Ray down and hands `result` (JSON) back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

from async_rl.core.messages import Sample, build_batch


def skewed_batch(rows: int = 16, seed: int = 0, vocab: int = 20):
    """A batch of `rows` responses, a quarter of them 30 tokens long and the rest 1-5, the long ones first."""
    rng = np.random.default_rng(seed)
    lengths = [int(x) for x in rng.integers(1, 6, rows)]
    lengths[: rows // 4] = [30] * (rows // 4)  # the long tail sits in the first rank's contiguous chunk
    samples = [
        Sample(uid=f"row{i}", prompt_ids=[1, 2, 3][: vocab - 1], response_ids=[int(t) for t in rng.integers(1, vocab, n)],
               rollout_log_probs=[-1.0] * n, token_versions=[0] * n)
        for i, n in enumerate(lengths)
    ]
    return build_batch(samples, max_prompt_length=4, max_response_length=32, pad_token_id=0)


PREAMBLE = '''
import json, os, sys
import numpy as np, ray, torch, verl
from hydra import compose, initialize_config_dir
sys.path.insert(0, sys.argv[3])
from async_rl.demo import demo_overrides
from async_rl.run_config import ray_init_kwargs
from async_rl.training import engine_calls
from async_rl.training.worker_groups import make_worker_group
from helpers.engine_workers import skewed_batch

demo_dir, out_path = sys.argv[1], sys.argv[2]
out_dir = os.path.dirname(out_path)


def demo_config(critic=False, **extra):
    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"),
                               version_base=None):
        return compose("ppo_trainer", overrides=demo_overrides(demo_dir, critic=critic, extra=extra))


def demo_batch():
    from transformers import AutoConfig
    return skewed_batch(vocab=AutoConfig.from_pretrained(os.path.join(demo_dir, "model")).vocab_size)


def done(result):
    ray.shutdown()
    json.dump(result, open(out_path, "w"))
'''


def run_on_workers(script: str, demo_dir: Path, tmp_path: Path, timeout_s: float = 600,
                   env: dict[str, str] | None = None) -> dict:
    """Run `PREAMBLE` + `script` in a fresh Python with the demo in `demo_dir`, in `tmp_path` (the script's
    `out_dir`), with `env` added to the environment; returns what it passed to `done`. Fails the test with the end
    of its output when it exits non-zero."""
    out = tmp_path / "result.json"
    tests_dir = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-c", PREAMBLE + textwrap.dedent(script), str(demo_dir), str(out), str(tests_dir)],
        cwd=tmp_path, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, capture_output=True, text=True,
        timeout=timeout_s,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return json.loads(out.read_text())
