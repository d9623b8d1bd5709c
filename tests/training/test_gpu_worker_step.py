"""The GPU check kit's trainer part (bench/gpu_worker_step.py) on the CPU: verl's FSDP2 engine trains through
`PipelineWorker` in one process, no Ray cluster (the GPU run: scripts/gpu_check.sh)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_worker_step_trains_through_the_pipeline_worker_without_a_ray_cluster(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_worker_step.py"), "--device", "cpu",
                          "--sizes", "tiny", "--steps", "2"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert re.search(r"^\[tiny\] model written in [\d.]+ s; PipelineWorker\(role=actor\) built and verl's FSDP2 engine "
                     r"initialised in [\d.]+ s$", run.stdout, re.M)
    steps = re.findall(r"^\[tiny\] step (\d): log-prob [\d.]+ s, update [\d.]+ s "
                       r"\(pg_loss (-?[\d.]+), grad_norm ([\d.]+)\), gather [\d.]+ s [\d.]+ GB/s "
                       r"\([\d.]+ x device copy\) of [\d.]+ GB; (\d+) of (\d+) tensors changed$", run.stdout, re.M)
    assert [s[0] for s in steps] == ["1", "2"]
    for _, loss, grad_norm, changed, total in steps:
        assert float(grad_norm) > 0
        # every weight of the tiny Qwen2 (its 2 layers, the embedding, the tied head) moved in each update
        assert int(changed) == int(total) >= 26
    assert steps[0][1] != steps[1][1]  # a new batch on new weights: another loss
    assert "ray started: False" in run.stdout
    assert not list(tmp_path.iterdir())  # the model folder was temporary
