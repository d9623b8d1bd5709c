"""Benchmark: what bounds a weight sync through Ray's object store on this machine.

`bench/param_update.py` compares the sync with a raw copy: memcpy of the model's bytes
split over every core, from one contiguous buffer into another, timed again and again into
the same destination. Three measurements here say how far any transport through the store
can come to it, each best of `--repeats` after the store has cycled once (a never-touched
page of the store is slow on its first write):

- put scaling: one `ray.put` of one contiguous array of `--put-mb` MB from one process,
  the same bytes as two halves put at the same moment from two processes, against memcpy
  on one core and on every core: does the store's copy use more than one core?
- cache: memcpy on every core of `--cache-mb` MB (the 10M model's bytes) into the same
  destination each time, as the raw copy is timed, against a fresh destination each time
  (rotating over `--rotate-mb` MB), as the store hands a put fresh memory; both best of
  as many copies.
- layout: the `--model` model's tensors (a size of bench/param_update.py) copied one by one
  into one contiguous buffer against the contiguous copy, both on one core; and one
  `ray.put` of the tensor list against one of a contiguous array.

Prints the numbers and the command that made them; `--json PATH` writes them.

    python bench/store_floor.py [--put-mb 512] [--cache-mb 34] [--rotate-mb 1536] [--model 100M] [--json PATH]
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import shlex
import sys
import time
from concurrent.futures import ThreadPoolExecutor

# bench/param_update.py would shadow the `param_update` package: drop this folder from the path
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != HERE]

import numpy as np  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

from param_update.buckets import tensor_bytes  # noqa: E402

MB = 1 << 20
TIMEOUT_S = 300


def _param_update_bench():
    """bench/param_update.py as a module (its synthetic models, `best_time_s`, `raw_copy_s`)."""
    spec = importlib.util.spec_from_file_location("bench_param_update", os.path.join(HERE, "param_update.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PU = _param_update_bench()


CORES = os.cpu_count() or 1


def copy_on_every_core(pool: ThreadPoolExecutor, dst: np.ndarray, src: np.ndarray) -> None:
    """memcpy of `src` into `dst`, one piece per core thread (np.copyto releases the GIL), as
    bench/param_update.py's raw copy."""
    list(pool.map(lambda pair: np.copyto(*pair), PU.pieces_per_core(dst, src, CORES)))


def cycle_store(put, nbytes: int, store_bytes: int) -> None:
    """Put-and-free objects of `nbytes` until the store's memory has been written once."""
    for _ in range(store_bytes // max(nbytes, 1) + 2):
        ref = put()
        del ref


@ray.remote
class Putter:
    """Holds `nbytes` random bytes and puts them into the store when told to."""

    def __init__(self, nbytes: int, store_bytes: int):
        self.array = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
        cycle_store(lambda: ray.put(self.array), nbytes, store_bytes)

    def put_at(self, wall_time: float) -> tuple[float, float]:
        """Sleep until `wall_time` (time.time()), put once; (start, end) wall times, the ref freed."""
        time.sleep(max(0.0, wall_time - time.time()))
        start = time.time()
        ref = ray.put(self.array)
        end = time.time()
        del ref
        return start, end


def concurrent_put_s(putters: list, repeats: int) -> float:
    """Best wall time (s) from the first put's start to the last put's end, all started at once."""
    walls = []
    for _ in range(repeats):
        at = time.time() + 0.2
        spans = ray.get([p.put_at.remote(at) for p in putters], timeout=TIMEOUT_S)
        walls.append(max(end for _, end in spans) - min(start for start, _ in spans))
    return min(walls)


def put_scaling(nbytes: int, store_bytes: int, repeats: int, pool: ThreadPoolExecutor) -> dict[str, float]:
    src = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8)
    dst = src.copy()
    out = {
        "memcpy_one_core_s": PU.best_time_s(lambda: np.copyto(dst, src), repeats),
        "memcpy_every_core_s": PU.best_time_s(lambda: copy_on_every_core(pool, dst, src), repeats),
    }
    for processes in (1, 2):
        putters = [Putter.remote(nbytes // processes, store_bytes // processes) for _ in range(processes)]
        out[f"put_{processes}_process_s"] = concurrent_put_s(putters, repeats)
        for p in putters:
            ray.kill(p, no_restart=True)
    return out


def cache(nbytes: int, rotate_bytes: int, repeats: int, pool: ThreadPoolExecutor) -> dict[str, float]:
    src = np.random.default_rng(2).integers(0, 255, nbytes, dtype=np.uint8)
    destinations = [src.copy() for _ in range(max(2, rotate_bytes // nbytes))]
    turn = itertools.count()
    copies = repeats * len(destinations)  # both best of as many copies: every destination `repeats` times
    return {
        "same_destination_s": PU.best_time_s(lambda: copy_on_every_core(pool, destinations[0], src), copies),
        "fresh_destination_s": PU.best_time_s(
            lambda: copy_on_every_core(pool, destinations[next(turn) % len(destinations)], src), copies
        ),
        "destinations": len(destinations),
    }


def layout(size: str, store_bytes: int, repeats: int) -> dict[str, float]:
    model = PU.build_model(size, seed=1)
    arrays = [tensor_bytes(t).numpy() for t in model.state_dict().values()]
    flat = np.concatenate(arrays)
    dst = flat.copy()
    offsets = np.cumsum([0] + [a.nbytes for a in arrays])

    def one_by_one():
        for i, array in enumerate(arrays):
            np.copyto(dst[offsets[i] : offsets[i + 1]], array)

    out = {
        "tensors": len(arrays),
        "model_mb": flat.nbytes / MB,
        "contiguous_copy_s": PU.best_time_s(lambda: np.copyto(dst, flat), repeats),
        "tensor_by_tensor_copy_s": PU.best_time_s(one_by_one, repeats),
    }
    cycle_store(lambda: ray.put(flat), flat.nbytes, store_bytes)
    out["put_contiguous_s"] = PU.best_time_s(lambda: ray.put(flat), repeats)
    out["put_tensor_list_s"] = PU.best_time_s(lambda: ray.put(arrays), repeats)
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--put-mb", type=float, default=512.0, help="bytes of the put-scaling test, MB")
    parser.add_argument("--cache-mb", type=float, default=34.0, help="bytes of the cache test, MB")
    parser.add_argument("--rotate-mb", type=float, default=1536.0, help="fresh destinations span this many MB")
    parser.add_argument("--model", default="100M", help=f"synthetic model of the layout test, of {list(PU.SIZES)}")
    parser.add_argument("--store-mb", type=float, default=2048.0, help="Ray's object store, MB")
    parser.add_argument("--repeats", type=int, default=8, help="best of this many")
    parser.add_argument("--json", help="write the numbers here")
    args = parser.parse_args(argv)
    command = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
    store_bytes = int(args.store_mb * MB)
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=store_bytes)
    try:
        with ThreadPoolExecutor(CORES) as pool:
            scaling = put_scaling(int(args.put_mb * MB), store_bytes, args.repeats, pool)
            cached = cache(int(args.cache_mb * MB), int(args.rotate_mb * MB), args.repeats, pool)
        laid_out = layout(args.model, store_bytes, args.repeats)
    finally:
        ray.shutdown()
    every = scaling["memcpy_every_core_s"]
    print(f"command: {command}\ncpus: {CORES}, ray {ray.__version__}, torch {torch.__version__}, "
          f"object store {args.store_mb:g} MB, best of {args.repeats}")
    print(f"put scaling, {args.put_mb:g} MB: memcpy one core {scaling['memcpy_one_core_s']:.4f}s, every core "
          f"{every:.4f}s | one put from 1 process {scaling['put_1_process_s']:.4f}s "
          f"({scaling['put_1_process_s'] / every:.2f}x every core), two halves from 2 processes at once "
          f"{scaling['put_2_process_s']:.4f}s ({scaling['put_2_process_s'] / every:.2f}x)")
    print(f"cache, {args.cache_mb:g} MB on every core: same destination {cached['same_destination_s']:.5f}s, "
          f"fresh destination (of {cached['destinations']}) {cached['fresh_destination_s']:.5f}s "
          f"({cached['fresh_destination_s'] / cached['same_destination_s']:.2f}x)")
    print(f"layout, {args.model} model ({laid_out['tensors']} tensors, {laid_out['model_mb']:.0f} MB), one core: "
          f"contiguous copy {laid_out['contiguous_copy_s']:.4f}s, tensor by tensor "
          f"{laid_out['tensor_by_tensor_copy_s']:.4f}s "
          f"({laid_out['tensor_by_tensor_copy_s'] / laid_out['contiguous_copy_s']:.2f}x) | one put: contiguous "
          f"{laid_out['put_contiguous_s']:.4f}s, tensor list {laid_out['put_tensor_list_s']:.4f}s "
          f"({laid_out['put_tensor_list_s'] / laid_out['put_contiguous_s']:.2f}x)")
    result = {"put_scaling": {"mb": args.put_mb, **scaling}, "cache": {"mb": args.cache_mb, **cached},
              "layout": {"model": args.model, **laid_out}, "command": command}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
