"""The GPU check kit (bench/gpu_check.py) on the CPU: its training step under FSDP2, the sync's device parts
between two processes, and the printed rates, at a tiny Qwen2 shape (the GPU run: scripts/gpu_check.sh)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from param_update.buckets import tensor_bytes

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("gather, load", [("tensor", "copy"), ("module", "swap")])
def test_gpu_check_cpu_path_loads_the_trained_weights_bit_for_bit(tmp_path, gather, load):
    # buckets of 50 KiB: the 64 KiB embedding is split across two, and the load copies 10 KiB groups
    run = subprocess.run([sys.executable, "bench/gpu_check.py", "--device", "cpu", "--sizes", "tiny",
                          "--bucket-mb", "0.05", "--consume-mb", "0.01", "--save-dir", str(tmp_path),
                          "--gather", gather, "--load", load, "--send-buffers", "3"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"through 3 send buffers, cpu, gather {gather}, load {load}; version 3 of 3:" in run.stdout
    before, after, loaded = (torch.load(tmp_path / f"{name}.pt") for name in ("before", "after", "receiver"))
    assert set(loaded) == set(after) and len(after) > 20
    assert [n for n in after if not tensor_bytes(loaded[n]).equal(tensor_bytes(after[n]))] == []
    assert any(not torch.equal(before[n], after[n]) for n in after)  # the training step changed the weights
    for part in ("gather", "send", "recv", "register", "load"):
        assert re.search(rf"^\[tiny\] {part} +[\d.]+ s +[\d.]+ GB/s +\([\d.]+ x device copy\)$", run.stdout, re.M), part
    assert re.search(r"^\[tiny\] device copy: [\d.]+ GB/s", run.stdout, re.M)
    assert "[tiny] bitwise: 0 of 26 tensors differ in each of 3 versions, 0 never loaded, 0 not the trainer's" in run.stdout
    assert len(re.findall(r"^\[tiny\] version \d: loss [\d.]+, sync [\d.]+ s, gather", run.stdout, re.M)) == 3
    assert run.stdout.count("imported none of ray, vllm, verl: True") == 2
