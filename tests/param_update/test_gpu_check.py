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


@pytest.mark.parametrize("gather, load, send", [("tensor", "copy", "ring"), ("module", "swap", "ring"),
                                                ("local", "swap", "region"), ("module", "copy", "region")])
def test_gpu_check_cpu_path_loads_the_trained_weights_bit_for_bit(tmp_path, gather, load, send):
    # buckets of 50 KiB: the 64 KiB embedding is split across two, and the load copies 10 KiB groups
    run = subprocess.run([sys.executable, "bench/gpu_check.py", "--device", "cpu", "--sizes", "tiny",
                          "--bucket-mb", "0.05", "--consume-mb", "0.01", "--save-dir", str(tmp_path),
                          "--gather", gather, "--load", load, "--send", send, "--send-buffers", "3"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    through = "through 3 send buffers" if send == "ring" else "into 2 regions"
    assert f"{through}, cpu, gather {gather}, load {load}; version 3 of 3:" in run.stdout
    # region + swap: every tensor but the split embedding serves from the trainer's memory, zero copy
    served = re.findall(r"^\[tiny\] version \d: (\d+) of 26 weights serve from the trainer's region", run.stdout, re.M)
    assert served == (["25"] * 3 if (send, load) == ("region", "swap") else [])
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
    assert re.search(r"^delta put together on cpu: version 2 loaded bit for bit: True \(\d+ bytes sent of 740010\)$",
                     run.stdout, re.M)


def test_local_gather_refuses_a_shard_that_is_not_the_whole_tensor():
    from bench.gpu_check import local_tensors

    class Sharded:
        shape = torch.Size([4, 2])

        def to_local(self):
            return torch.zeros(2, 2)  # half the rows: a two-rank shard

    class Model:
        def named_parameters(self):
            return [("w", Sharded())]

    with pytest.raises(SystemExit, match=r"--gather local needs one rank: w's shard is \(2, 2\) of \(4, 2\)"):
        list(local_tensors(Model()))
