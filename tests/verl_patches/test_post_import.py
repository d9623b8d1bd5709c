"""Patches applied when their module is imported (verl_patches/post_import.py), and a CPU run's worker
set-up (async_rl/verl_trainer_on_cpu.py) that loads none of verl's engines or replicas until a process
imports them, yet patches and registers them when it does."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from verl_patches.post_import import pending, when_imported


def run_python(code: str, env_platform: bool = True) -> str:
    """`code` in a fresh interpreter (VERL_PLATFORM=cpu: a CPU run's Ray worker); returns its stdout."""
    env = dict(os.environ, VERL_PLATFORM="cpu") if env_platform else dict(os.environ)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_a_patch_waits_for_its_module_and_runs_once(tmp_path, monkeypatch):
    (tmp_path / "late_module.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    calls = []
    when_imported("late_module", lambda: calls.append(sys.modules["late_module"].VALUE))
    assert calls == [] and "late_module" in pending()
    import late_module

    assert calls == [1] and "late_module" not in pending()
    assert type(late_module.__loader__).__name__ == "SourceFileLoader"  # the module keeps its own loader
    when_imported("late_module", lambda: calls.append("again"))  # already loaded: at once
    assert calls == [1, "again"]


def test_a_name_imported_from_the_module_afterwards_is_the_patched_one(tmp_path, monkeypatch):
    (tmp_path / "patched_module.py").write_text("def f():\n    return 'original'\n")
    (tmp_path / "patched_user.py").write_text("from patched_module import f\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def patch():
        sys.modules["patched_module"].f = lambda: "patched"

    when_imported("patched_module", patch)
    import patched_user

    assert patched_user.f() == "patched"


def test_a_cpu_workers_import_verl_loads_no_engine_yet_patches_it_when_loaded():
    out = run_python("""
        import sys
        import verl  # the plugin sets up the CPU worker (VERL_PLATFORM=cpu)
        heavy = ["verl.workers.engine_workers", "verl.workers.engine.fsdp.transformer_impl",
                 "verl.workers.rollout.replica", "verl.experimental.reward_loop.reward_loop",
                 "async_rl.rollout.cpu.replica"]
        print("loaded at import verl:", [m for m in heavy if m in sys.modules])
        import inspect
        import verl.utils.distributed as dist_utils
        import verl.workers.engine_workers as engine_workers
        import verl.workers.engine.fsdp.transformer_impl as fsdp_impl
        from verl.experimental.reward_loop.reward_loop import RewardLoopWorker
        from verl.workers.rollout.base import _ROLLOUT_REGISTRY
        from verl.workers.rollout.replica import get_rollout_replica_class
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        print("gloo:", engine_workers.initialize_global_process_group_ray is dist_utils.initialize_global_process_group_ray
              and inspect.unwrap(dist_utils.initialize_global_process_group_ray) is not dist_utils.initialize_global_process_group_ray)
        print("unpinned:", fsdp_impl.CPUOffloadPolicy(pin_memory=True).pin_memory)
        print("disrm:", getattr(RewardLoopWorker.compute_score_disrm, "_async_rl_cpu_reward_model", False))
        print("sdpa:", getattr(ALL_ATTENTION_FUNCTIONS["sdpa"], "_async_rl_ulysses_sdpa", False))
        print("packed sdpa:", getattr(ALL_ATTENTION_FUNCTIONS["sdpa"], "_async_rl_packed_sdpa", False))
        print("adapter:", _ROLLOUT_REGISTRY[("cpu", "async")])
        print("replica:", get_rollout_replica_class("cpu").__name__)
    """)
    assert "loaded at import verl: []" in out
    for line in ("gloo: True", "unpinned: False", "disrm: True", "sdpa: True", "packed sdpa: True",
                 "replica: CPURolloutReplica",
                 "adapter: async_rl.rollout.cpu.adapter.CPUServerAdapter"):
        assert line in out, out


def test_without_the_cpu_platform_verl_is_left_alone():
    out = run_python("""
        import verl
        import verl.workers.engine.fsdp.transformer_impl as fsdp_impl
        from verl.workers.rollout.base import _ROLLOUT_REGISTRY
        print("unpinned:", fsdp_impl.CPUOffloadPolicy(pin_memory=True).pin_memory)
        print("cpu registered:", ("cpu", "async") in _ROLLOUT_REGISTRY)
    """, env_platform=False)
    assert "unpinned: True" in out and "cpu registered: False" in out


def test_a_cpu_worker_records_the_patches_it_applied(tmp_path):
    """`$ASYNC_RL_PATCH_LOG` (what bench/e2e.py reports per run): each patch applied in a CPU worker appends its
    name and process, when its module is imported; a process that loads no engine records no engine patch."""
    from verl_patches.cpu_patches import PATCH_LOG_ENV, applied_patches

    log = tmp_path / "patches.jsonl"
    env = dict(os.environ, VERL_PLATFORM="cpu", **{PATCH_LOG_ENV: str(log)})
    code = "import os, verl\n{}print(os.getpid())\n"
    engine = subprocess.run([sys.executable, "-c", code.format("import verl.workers.engine.fsdp.transformer_impl\n")],
                            capture_output=True, text=True, env=env, timeout=120)
    bare = subprocess.run([sys.executable, "-c", code.format("")], capture_output=True, text=True, env=env, timeout=120)
    assert engine.returncode == 0 and bare.returncode == 0, (engine.stderr + bare.stderr)[-3000:]
    applied = applied_patches(str(log))
    in_engine = applied[int(engine.stdout.split()[-1])]
    assert {"patch_unpinned_cpu_offload", "patch_sdpa_attention",
            "patch_row_block_logprobs"} <= in_engine
    assert "patch_unpinned_cpu_offload" not in applied.get(int(bare.stdout.split()[-1]), set())
