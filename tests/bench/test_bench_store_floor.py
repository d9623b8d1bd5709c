"""bench/store_floor.py runs and writes its four measurements (tiny sizes)."""

from __future__ import annotations

import json

from bench import param_update as bench_param_update
from bench_script import run_bench


def test_store_floor_prints_and_writes_json(tmp_path):
    out = tmp_path / "floor.json"
    args = ["--put-mb", "16", "--cache-mb", "4", "--rotate-mb", "32", "--model", "2M", "--store-mb", "256",
            "--repeats", "2", "--json", str(out)]
    proc = run_bench("store_floor.py", args, tmp_path)
    assert "command: " in proc.stdout and "store_floor.py --put-mb 16" in proc.stdout
    result = json.loads(out.read_text())
    scaling, cache, layout, stores = (result[k] for k in ("put_scaling", "cache", "layout", "store_type"))
    assert scaling["mb"] == 16 and all(scaling[k] > 0 for k in (
        "memcpy_one_core_s", "memcpy_one_core_ray_pieces_s", "memcpy_every_core_s", "memcpy_ray_pieces_s",
        "put_1_process_s", "put_2_process_s", "put_1_process_cores_busy", "put_2_process_cores_busy"))
    # a put of 16 MB (one buffer over Ray's 1 MB threshold) copies on threads it starts for it
    assert scaling["put_threads_started"] >= 2
    assert cache["destinations"] == 8 and cache["same_destination_s"] > 0 and cache["fresh_destination_s"] > 0
    # the layout test walks the 2M model of bench/param_update.py, every tensor of it
    from transformers import Qwen2ForCausalLM

    
    expected = Qwen2ForCausalLM(bench_param_update.model_config("2M")).state_dict()
    assert layout["tensors"] == len(expected)
    assert abs(layout["model_mb"] - sum(t.nbytes for t in expected.values()) / (1 << 20)) < 1e-6
    assert all(layout[k] > 0 for k in ("contiguous_copy_s", "tensor_by_tensor_copy_s", "put_contiguous_s",
                                       "put_tensor_list_s"))
    # the store-type copies ran in a child process with glibc's non-temporal threshold lowered
    assert stores["mb"] == 16 and stores["glibc_tunables"] == "glibc.cpu.x86_non_temporal_threshold=0x100000"
    assert stores["one_core_s"] > 0 and stores["one_core_ray_pieces_s"] > 0
    for line in ("put scaling, 16 MB: memcpy one core", "in 6 pieces on 6 threads, as a put copies", "threads started",
                 "cache, 4 MB on every core:", "layout, 2M model (27 tensors",
                 "store type, 16 MB on one core with GLIBC_TUNABLES="):
        assert line in proc.stdout
