"""Benchmark: what bounds a weight sync through Ray's object store on this machine.

`bench/param_update.py` compares the sync with a raw copy: memcpy of the model's bytes
split over every core, from one contiguous buffer into another, timed again and again into
the same destination. Four measurements here say how far any transport through the store
can come to it, each best of `--repeats` after the store has cycled once (a never-touched
page of the store is slow on its first write):

- put scaling: one `ray.put` of one contiguous array of `--put-mb` MB from one process,
  the same bytes as two halves put at the same moment from two processes, against memcpy
  on one core and on every core, each as one piece per thread and as the put copies: Ray's
  serializer copies every buffer over 1 MB in `RAY_MEMCOPY_THREADS` pieces, on as many
  threads it starts for that buffer (python/ray/includes/serialization.pxi). Also: the
  threads a put starts in the putting process and the cores it keeps busy (CPU seconds of
  that process over the put's wall seconds).
- cache: memcpy on every core of `--cache-mb` MB (the 10M model's bytes) into the same
  destination each time, as the raw copy is timed, against a fresh destination each time
  (rotating over `--rotate-mb` MB), as the store hands a put fresh memory; both best of
  as many copies.
- layout: the `--model` model's tensors (a size of bench/param_update.py) copied one by one
  into one contiguous buffer against the contiguous copy, both on one core; and one
  `ray.put` of the tensor list against one of a contiguous array.
- store type: memcpy on one core in one piece and in Ray's pieces again, in a child
  process whose glibc uses non-temporal stores from 1 MB on (`GLIBC_TUNABLES`; by default
  only above a threshold it derives from the shared cache's size: `ld.so --list-tunables`
  shows it as `glibc.cpu.x86_non_temporal_threshold`). If the pieces cost the same there,
  the gap between the piece sizes is glibc's choice of store, not the copy's size or its
  threads.

Prints the numbers and the command that made them; `--json PATH` writes them.

    python bench/store_floor.py [--put-mb 512] [--cache-mb 34] [--rotate-mb 1536] [--model 100M] [--json PATH]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

# bench/param_update.py would shadow the `param_update` package: drop this folder from the path
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != HERE]
sys.path.insert(0, os.path.dirname(HERE))  # the repository root

import numpy as np  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

from bench import param_update as PU  # noqa: E402 - its synthetic models, `best_time_s`, `raw_copy_s`
from bench.command import command_line  # noqa: E402
from param_update.buckets import tensor_bytes  # noqa: E402

MB = 1 << 20
TIMEOUT_S = 300
RAY_MEMCOPY_THREADS = 6  # python/ray/includes/serialization.pxi (MEMCOPY_THREADS); `threads_started_by_put` checks it




CORES = os.cpu_count() or 1


def random_bytes(nbytes: int, seed: int) -> np.ndarray:
    """`nbytes` random uint8 bytes (every page written)."""
    return np.random.default_rng(seed).integers(0, 255, nbytes, dtype=np.uint8)


def copy_on_every_core(pool: ThreadPoolExecutor, dst: np.ndarray, src: np.ndarray, pieces: int = CORES) -> None:
    """memcpy of `src` into `dst` in `pieces` pieces on `pool`'s threads (np.copyto releases the
    GIL); one piece per core is bench/param_update.py's raw copy."""
    list(pool.map(lambda pair: np.copyto(*pair), PU.pieces_per_core(dst, src, pieces)))


def copy_in_pieces(dst: np.ndarray, src: np.ndarray, pieces: int) -> None:
    """memcpy of `src` into `dst` in `pieces` pieces, one after another on this thread."""
    for pair in PU.pieces_per_core(dst, src, pieces):
        np.copyto(*pair)


def cycle_store(put, nbytes: int, store_bytes: int) -> None:
    """Put-and-free objects of `nbytes` until the store's memory has been written once."""
    for _ in range(store_bytes // max(nbytes, 1) + 2):
        ref = put()
        del ref


@ray.remote
class Putter:
    """Holds `nbytes` random bytes and puts them into the store when told to."""

    def __init__(self, nbytes: int, store_bytes: int):
        self.array = random_bytes(nbytes, seed=0)
        cycle_store(lambda: ray.put(self.array), nbytes, store_bytes)

    def put_at(self, wall_time: float) -> tuple[float, float, float]:
        """Sleep until `wall_time` (time.time()), put once; (start, end) wall times and this
        process's CPU seconds (every thread) over the put; the ref freed."""
        time.sleep(max(0.0, wall_time - time.time()))
        cpu = time.process_time()
        start = time.time()
        ref = ray.put(self.array)
        end = time.time()
        cpu = time.process_time() - cpu
        del ref
        return start, end, cpu

    def threads_started_by_put(self, puts: int = 30) -> int:
        """The most threads this process had during up to `puts` puts, less those it had before
        (Linux: a watcher thread counts /proc/self/task; untimed, the watcher spins). Stops once
        two extra threads were seen: on a loaded machine the watcher can miss a put's short-lived
        copy threads, so one put is not enough to see them."""
        def count() -> int:
            return len(os.listdir("/proc/self/task"))

        peak, done = [0], threading.Event()

        def watch():
            while not done.is_set():
                peak[0] = max(peak[0], count())

        watcher = threading.Thread(target=watch)
        watcher.start()
        before = count()  # the watcher included
        for _ in range(puts):
            ref = ray.put(self.array)
            del ref
            if peak[0] - before >= 2:
                break
        done.set()
        watcher.join()
        return peak[0] - before


def concurrent_put(putters: list, repeats: int) -> dict[str, float]:
    """Of the fastest of `repeats` rounds, all puts started at once: `wall_s`, from the first
    put's start to the last put's end, and `cores_busy`, the putters' CPU seconds over it."""
    rounds = []
    for _ in range(repeats):
        at = time.time() + 0.2
        spans = ray.get([p.put_at.remote(at) for p in putters], timeout=TIMEOUT_S)
        wall = max(end for _, end, _ in spans) - min(start for start, _, _ in spans)
        rounds.append({"wall_s": wall, "cores_busy": sum(cpu for _, _, cpu in spans) / wall})
    return min(rounds, key=lambda r: r["wall_s"])


def memcpy_pieces(dst: np.ndarray, src: np.ndarray, repeats: int) -> dict[str, float]:
    """memcpy of `src` into `dst` on this thread in one piece and in Ray's pieces (best of `repeats`, s)."""
    return {
        "one_core_s": PU.best_time_s(lambda: np.copyto(dst, src), repeats),
        "one_core_ray_pieces_s": PU.best_time_s(lambda: copy_in_pieces(dst, src, RAY_MEMCOPY_THREADS), repeats),
    }


def put_scaling(nbytes: int, store_bytes: int, repeats: int, pool: ThreadPoolExecutor) -> dict[str, float]:
    src = random_bytes(nbytes, seed=1)
    dst = src.copy()
    out = {f"memcpy_{key}": seconds for key, seconds in memcpy_pieces(dst, src, repeats).items()}
    out["memcpy_every_core_s"] = PU.best_time_s(lambda: copy_on_every_core(pool, dst, src), repeats)
    with ThreadPoolExecutor(RAY_MEMCOPY_THREADS) as ray_like:
        out["memcpy_ray_pieces_s"] = PU.best_time_s(
            lambda: copy_on_every_core(ray_like, dst, src, RAY_MEMCOPY_THREADS), repeats)
    for processes in (1, 2):
        putters = [Putter.remote(nbytes // processes, store_bytes // processes) for _ in range(processes)]
        put = concurrent_put(putters, repeats)
        out[f"put_{processes}_process_s"] = put["wall_s"]
        out[f"put_{processes}_process_cores_busy"] = put["cores_busy"]
        if processes == 1:
            out["put_threads_started"] = ray.get(putters[0].threads_started_by_put.remote(), timeout=TIMEOUT_S)
        for p in putters:
            ray.kill(p, no_restart=True)
    return out


NON_TEMPORAL_FROM_1MB = "glibc.cpu.x86_non_temporal_threshold=0x100000"


def store_type(nbytes: int, repeats: int) -> dict[str, float]:
    """`memcpy_pieces` in a child process whose glibc stores non-temporally from 1 MB on (with the
    GLIBC_TUNABLES the child saw)."""
    env = {**os.environ, "GLIBC_TUNABLES": NON_TEMPORAL_FROM_1MB}
    child = subprocess.run([sys.executable, os.path.abspath(__file__), "--pieces-only", "--put-mb", str(nbytes / MB),
                            "--repeats", str(repeats)], env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    if child.returncode != 0:
        raise RuntimeError(f"the store-type child failed: {child.stderr[-2000:]}")
    return json.loads(child.stdout.strip().splitlines()[-1])


def cache(nbytes: int, rotate_bytes: int, repeats: int, pool: ThreadPoolExecutor) -> dict[str, float]:
    src = random_bytes(nbytes, seed=2)
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
    parser.add_argument("--pieces-only", action="store_true", help=argparse.SUPPRESS)  # store_type's child
    args = parser.parse_args(argv)
    if args.pieces_only:
        src = random_bytes(int(args.put_mb * MB), seed=3)
        print(json.dumps({"glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
                          **memcpy_pieces(src.copy(), src, args.repeats)}))
        return {}
    command = command_line()
    store_bytes = int(args.store_mb * MB)
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=store_bytes)
    try:
        with ThreadPoolExecutor(CORES) as pool:
            scaling = put_scaling(int(args.put_mb * MB), store_bytes, args.repeats, pool)
            cached = cache(int(args.cache_mb * MB), int(args.rotate_mb * MB), args.repeats, pool)
        laid_out = layout(args.model, store_bytes, args.repeats)
    finally:
        ray.shutdown()
    stores = store_type(int(args.put_mb * MB), args.repeats)
    one, every, ray_pieces = (scaling[k] for k in ("memcpy_one_core_s", "memcpy_every_core_s", "memcpy_ray_pieces_s"))
    print(f"command: {command}\ncpus: {CORES}, ray {ray.__version__}, torch {torch.__version__}, "
          f"object store {args.store_mb:g} MB, best of {args.repeats}")
    print(f"put scaling, {args.put_mb:g} MB: memcpy one core {one:.4f}s (in {RAY_MEMCOPY_THREADS} pieces "
          f"{scaling['memcpy_one_core_ray_pieces_s']:.4f}s, {scaling['memcpy_one_core_ray_pieces_s'] / one:.2f}x), "
          f"every core {every:.4f}s (in {RAY_MEMCOPY_THREADS} pieces on {RAY_MEMCOPY_THREADS} threads, as a put "
          f"copies: {ray_pieces:.4f}s, {ray_pieces / every:.2f}x) | one put from 1 process "
          f"{scaling['put_1_process_s']:.4f}s ({scaling['put_1_process_s'] / every:.2f}x every core, "
          f"{scaling['put_1_process_s'] / ray_pieces:.2f}x as a put copies; {scaling['put_threads_started']} "
          f"threads started, {scaling['put_1_process_cores_busy']:.2f} cores busy), two halves from 2 processes "
          f"at once {scaling['put_2_process_s']:.4f}s ({scaling['put_2_process_s'] / every:.2f}x every core, "
          f"{scaling['put_2_process_cores_busy']:.2f} cores busy)")
    print(f"cache, {args.cache_mb:g} MB on every core: same destination {cached['same_destination_s']:.5f}s, "
          f"fresh destination (of {cached['destinations']}) {cached['fresh_destination_s']:.5f}s "
          f"({cached['fresh_destination_s'] / cached['same_destination_s']:.2f}x)")
    print(f"layout, {args.model} model ({laid_out['tensors']} tensors, {laid_out['model_mb']:.0f} MB), one core: "
          f"contiguous copy {laid_out['contiguous_copy_s']:.4f}s, tensor by tensor "
          f"{laid_out['tensor_by_tensor_copy_s']:.4f}s "
          f"({laid_out['tensor_by_tensor_copy_s'] / laid_out['contiguous_copy_s']:.2f}x) | one put: contiguous "
          f"{laid_out['put_contiguous_s']:.4f}s, tensor list {laid_out['put_tensor_list_s']:.4f}s "
          f"({laid_out['put_tensor_list_s'] / laid_out['put_contiguous_s']:.2f}x)")
    print(f"store type, {args.put_mb:g} MB on one core with GLIBC_TUNABLES={stores['glibc_tunables']}: one piece "
          f"{stores['one_core_s']:.4f}s, in {RAY_MEMCOPY_THREADS} pieces {stores['one_core_ray_pieces_s']:.4f}s "
          f"({stores['one_core_ray_pieces_s'] / stores['one_core_s']:.2f}x; "
          f"{scaling['memcpy_one_core_ray_pieces_s'] / one:.2f}x without)")
    result = {"put_scaling": {"mb": args.put_mb, **scaling}, "cache": {"mb": args.cache_mb, **cached},
              "layout": {"model": args.model, **laid_out}, "store_type": {"mb": args.put_mb, **stores},
              "command": command}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
