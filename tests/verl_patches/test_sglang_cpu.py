"""What verl's SGLang rollout needs on SGLang's CPU build (verl_patches/sglang_cpu.py).

The test that needs SGLang itself is marked `sglang` and runs in .venv-sglang
(`bash scripts/test.sh --sglang`)."""

from __future__ import annotations

import importlib.metadata

import pytest
from omegaconf import OmegaConf

from verl_patches import sglang_cpu


def rollout_config(**kwargs):
    return OmegaConf.create({"free_cache_engine": True, "engine_kwargs": {"vllm": {}, "sglang": {}}, **kwargs})


def test_cpu_overrides_set_what_sglang_needs_on_cpu_and_say_so():
    rollout = rollout_config()
    changed = sglang_cpu.cpu_rollout_overrides(rollout)
    assert rollout.free_cache_engine is False
    assert dict(rollout.engine_kwargs.sglang) == sglang_cpu.CPU_ENGINE_KWARGS
    assert "free_cache_engine=False" in changed and "engine_kwargs.sglang.device=cpu" in changed
    assert sglang_cpu.cpu_rollout_overrides(rollout) == []  # a second call changes nothing


def test_cpu_overrides_keep_what_the_user_set_under_engine_kwargs():
    rollout = rollout_config(engine_kwargs={"sglang": {"mem_fraction_static": 0.2, "attention_backend": "intel_amx"}})
    changed = sglang_cpu.cpu_rollout_overrides(rollout)
    assert rollout.engine_kwargs.sglang.mem_fraction_static == 0.2
    assert rollout.engine_kwargs.sglang.attention_backend == "intel_amx"
    assert rollout.engine_kwargs.sglang.device == "cpu"
    assert not any("mem_fraction_static" in c or "attention_backend" in c for c in changed)


def test_cpu_overrides_fill_a_missing_engine_kwargs_section():
    rollout = OmegaConf.create({"free_cache_engine": False})
    sglang_cpu.cpu_rollout_overrides(rollout)
    assert rollout.engine_kwargs.sglang.enable_memory_saver is False


def test_sglang_cpu_counts_as_installed_only_with_its_cpu_kernels(monkeypatch):
    def only(*names):
        def distribution(name):
            if name in names:
                return object()
            raise importlib.metadata.PackageNotFoundError(name)
        return distribution

    monkeypatch.setattr(importlib.metadata, "distribution", only("sglang"))
    assert not sglang_cpu.sglang_cpu_installed()  # SGLang with its CUDA kernels (or none)
    monkeypatch.setattr(importlib.metadata, "distribution", only("sglang", "sglang-kernel-cpu"))
    assert sglang_cpu.sglang_cpu_installed()


@pytest.mark.sglang
def test_sglang_takes_the_overrides_as_a_cpu_server(monkeypatch, demo_dir):
    """verl's SGLangHttpServer arguments for a GPU (memory saver, flashinfer) with the overrides merged
    last, as verl merges `engine_kwargs.sglang`: SGLang's ServerArgs resolves them to a CPU server."""
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    from sglang.srt.server_args import ServerArgs

    rollout = rollout_config()
    sglang_cpu.cpu_rollout_overrides(rollout)
    verls = {"enable_memory_saver": True, "attention_backend": "flashinfer", "mem_fraction_static": 0.5}
    args = {**verls, **OmegaConf.to_container(rollout.engine_kwargs.sglang)}
    server_args = ServerArgs(model_path=str(demo_dir / "model"), **args)
    assert server_args.device == "cpu" and server_args.enable_memory_saver is False
    assert server_args.attention_backend == "torch_native" and server_args.disable_overlap_schedule
    assert server_args.mem_fraction_static == 0.05


RECEIVE = """
import sys, torch
from sglang.srt.utils import MultiprocessingSerializer
tensor = MultiprocessingSerializer.deserialize(sys.stdin.read())
print(float(tensor.sum()), list(tensor.shape))
"""


@pytest.mark.sglang
def test_a_cpu_tensor_reaches_an_unrelated_process_through_sglangs_weight_serializer(monkeypatch):
    """verl's weight path into SGLang pickles each tensor with SGLang's serializer after SGLang's
    reductions; unpatched a CPU tensor fails there, patched another process (SGLang's scheduler is
    one: not a child of the sender) rebuilds it."""
    import subprocess
    import sys

    import torch
    import torch.multiprocessing
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    strategy = torch.multiprocessing.get_sharing_strategy()
    try:
        monkey_patch_torch_reductions()
        tensor = torch.arange(12, dtype=torch.float32).reshape(3, 4)
        with pytest.raises(IndexError):
            MultiprocessingSerializer.serialize(tensor)
        sglang_cpu.patch_cpu_weight_transfer()
        sglang_cpu.patch_cpu_weight_transfer()  # idempotent
        payload = MultiprocessingSerializer.serialize(tensor, output_str=True)
        out = subprocess.run([sys.executable, "-c", RECEIVE], input=payload, capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip().splitlines()[-1] == "66.0 [3, 4]"  # 0 + 1 + ... + 11
    finally:
        torch.multiprocessing.set_sharing_strategy(strategy)


def test_the_weight_transfer_patch_waits_for_sglang_only_where_its_cpu_build_is(monkeypatch):
    from verl_patches import post_import

    monkeypatch.setattr(sglang_cpu, "sglang_cpu_installed", lambda: False)
    sglang_cpu.apply_sglang_cpu_patches()
    assert "sglang.srt.weight_sync.utils" not in post_import.pending()
    monkeypatch.setattr(sglang_cpu, "sglang_cpu_installed", lambda: True)
    monkeypatch.setattr(post_import, "_PENDING", {})
    sglang_cpu.apply_sglang_cpu_patches()
    assert "sglang.srt.weight_sync.utils" in post_import.pending()
