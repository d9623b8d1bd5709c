"""Benchmark: the five-part weight sync against a naive blocking sync and a raw memory copy.

For synthetic Qwen2 models of about 10M, 100M and 500M parameters (float32), on this
machine, in one run, on a local two-node Ray cluster (`ray.cluster_utils.Cluster`: two
raylets and object stores on this machine, told apart by node id as two machines are):

- pipeline, same node: this project's sync (param_update/) with the CPU rollout server on
  the trainer's node: the trainer gathers into buckets and its send thread writes each
  once into its shared buffer (a /dev/shm region the server maps, no object-store put);
  once the last bucket is written, the param_update stage has the server register the whole
  version in its dual buffer (views, one call) while it keeps generating; the load swaps
  the halves between two decoding steps.
- pipeline, other node: the same with the server on the second node: buckets travel
  through Ray's object store (put on the trainer's node, fetched to the server's); then, to the
  same server from a second param_update stage, through the collective transport (each bucket
  copied once into the trainer's shared buffer and sent in a gloo group to the server's process).
- naive: stop-the-world, as verl's standalone sync does it (abort and pause generation,
  gather everything, one put, load in full, resume): generation is blocked throughout.
- raw link: the same bytes sent once in a gloo group from the trainer's process to a process on
  the second node (the collective transport's link: loopback TCP between the two raylets' processes
  here), until that process has them (a one-byte answer closes the timing), the best of three.
- raw copy: a copy of the same bytes in one process, the physical limit here: the faster
  of torch's `copy_` (on its intra-op threads) and memcpy split across every core
  (`np.copyto` per core; 1.5-1.7x faster than torch's at 100M and 500M here), each the best
  of ten, measured twice (right after the idle syncs and at the end of the size) and the
  faster kept: the baseline moved 0.053-0.075 s at 500M between runs.

The object store's own floor (one put of the same bytes, the sender's puts alone) is
bench/store_floor.py's: measured here after the syncs, the puts met a store full of what
they had left and spilled, which made them 7-26x the raw copy.

Per size: total sync latency, the time generation was blocked, and how much a training
step (forward + backward) that runs while the pipeline's sync is in flight slows down
against the same step alone. The CPU rollout server decodes requests throughout. The
load's wait for a decoding step already running when the weights are ready (the engine
swaps between steps: a scheduling choice, not transport) is reported in its own column
(`step wait`) and left out of every total.

Put threads: the pipeline puts each bucket as several objects from several threads at
once, or on the same node writes it into shared memory as as many pieces at once
(`BucketSender(put_threads=...)`; the main table is the same-node link's). `--put-threads 4,1` runs the pipeline with each
count in turn, sync by sync, so the comparison sees the same machine state; the main
table shows the first count.

Spacing: in the pipeline a whole training step separates two syncs, so by the next load
the server has long finished the re-prefill that follows the previous one (every live
row's prefix, recomputed under the new weights) and is decoding. Syncs here start
likewise only once the server has run `SETTLE_STEPS` steps since its last load; back to
back, a load would mostly wait for that re-prefill (0.36 s median at 493M, commit d4a2978).

Steady state: the first syncs of a run write into never-touched pages (of the shared
buffer's two regions on the same node, of Ray's object stores across nodes), and a
page's first touch is slow on this machine (through the object store the first sync took
2.2-7.7x a later one); later syncs reuse pages. The bench reports the first sync (cold)
apart, then syncs until every region was written once (same node) or the store has
cycled once (other node) and measures after that: latency with generation decoding, and the
training slowdown in further syncs that run beside a training step (their latency is
reported too: both share two cores). Last, with the generation load stopped, three more
syncs measure the latency on an idle machine, as the raw copy is measured: the
transport's own cost without contention.

The same-node part runs first, then its server is stopped and the other-node part runs
(decoding, then the naive sync against that server).

    python bench/param_update.py [--sizes 10M,100M,500M] [--put-threads 4,1] [--json PATH]

The trainer here is one process (its gather is a walk over its state dict); in the
pipeline the same code walks verl's FSDP2 per-tensor generator.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

# this file's name shadows the `param_update` package when run as a script: drop its folder
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
from bench.command import command_line  # noqa: E402
from bench.link import LinkProbe, gloo_send_s, node_ids, two_node_cluster  # noqa: E402

import ray  # noqa: E402
import torch  # noqa: E402

from param_update.sender import PUT_THREADS  # noqa: E402

SIZES = {"2M": (64, 2), "10M": (256, 6), "100M": (768, 12), "500M": (1280, 24)}  # hidden, layers
VOCAB = 8192
TIMEOUT_S = 900
MAX_WARMUP_SYNCS = 40  # small models: the store's allocator reuses freed pages well before it cycles
TOTAL = "timing_s/param_update/total"
STEP_WAIT = "async/param_update/step_wait_s"
SETTLE_STEPS = 2  # server steps after a load (its re-prefill, one decoding step) before the next sync starts
LINK_NAMES = ("shm", "collective", "store")  # the transports a link row counts receivers of


def model_config(size: str):
    from transformers import Qwen2Config

    hidden, layers = SIZES[size]
    return Qwen2Config(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=128, tie_word_embeddings=False, dtype="float32",
    )


def build_model(size: str, seed: int):
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(model_config(size)).to(torch.float32)


@ray.remote
class Trainer:
    """The training side: a model, the bucket sender, a training step."""

    def __init__(self, size: str, seed: int, put_threads: list[int]):
        from param_update.sender import BucketSender
        from param_update.transports.object_store import ObjectStore
        from param_update.transports.shared_memory import SharedMemory

        self.model = build_model(size, seed)
        # one set of shared-memory files whatever the put-thread count
        self.transports = {"shm": SharedMemory(), "store": ObjectStore()}
        self.senders = {n: BucketSender(put_threads=n, transports=self.transports) for n in put_threads}
        self.batch = torch.randint(0, VOCAB, (4, 64))

    def save(self, path: str) -> None:
        """The server starts from these weights (saved here: the driver never holds a model)."""
        self.model.save_pretrained(path)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def send(self, version: int, bucket_bytes: int, sink, put_threads: int) -> float:
        """gather + hand buckets to the send thread; returns when the gather is done."""
        from param_update.sender import live_storage_addresses

        state = self.model.state_dict()
        live = live_storage_addresses(state.values())
        sender = self.senders[put_threads]
        return sender.gather_and_send(state.items(), version, bucket_bytes, sink, True, live)["gather_s"]

    def close(self) -> None:
        """Unlink the senders' shared-memory files (the collective's buffer too)."""
        for sender in self.senders.values():
            sender.close()

    def raw_link_s(self, nbytes: int, probe) -> float:
        """The fastest of three gloo sends of `nbytes` from here to `probe` (on the other node) (s)."""
        return gloo_send_s(nbytes, probe)

    def gather_all(self):
        """naive gather + put: every tensor in one object (one copy, as the pipeline's put)."""
        return ray.put(list(self.model.state_dict().items()))

    def raw_copy_s(self, nbytes: int) -> dict[str, float]:
        """The raw copy measured in this process, while the rollout server keeps decoding."""
        return raw_copy_s(nbytes)

    def train_step(self) -> float:
        """Seconds of one forward + backward (no optimizer)."""
        start = time.perf_counter()
        self.model.zero_grad(set_to_none=True)
        self.model(input_ids=self.batch, labels=self.batch).loss.backward()
        seconds = time.perf_counter() - start
        self.model.zero_grad(set_to_none=True)  # free the gradients' memory between steps
        return seconds


def rollout_server_class():
    """The CPU rollout server, counting its steps since its last load (the bench spaces syncs by them)."""
    from async_rl.rollout.cpu.server import CPURolloutServer

    class BenchRolloutServer(CPURolloutServer):
        _steps_at_load = 0

        async def commit_weights(self, version: int, num_buckets: int) -> dict[str, float]:
            result = await super().commit_weights(version, num_buckets)
            self._steps_at_load = self.engine.num_steps
            return result

        def steps_since_load(self) -> int:
            return self.engine.num_steps - self._steps_at_load

    return BenchRolloutServer


@ray.remote
class VersionLog:
    def __init__(self):
        self.versions = []

    def set_served_version(self, version: int) -> None:
        self.versions.append(version)


@ray.remote
class LoadGenerator:
    """Keeps `concurrency` requests decoding on the server until stopped; counts tokens."""

    def __init__(self, server, concurrency: int = 4):
        self.server = server
        self.concurrency = concurrency
        self.running = False
        self.tokens = 0

    async def client(self, k: int) -> None:
        i = 0
        while self.running:
            out = await self.server.generate.remote(
                prompt_ids=[1, 2, 3, 4], sampling_params={"temperature": 1.0, "max_tokens": 32},
                request_id=f"bench-{k}-{i}",
            )
            self.tokens += len(out.token_ids)
            i += 1

    async def run(self) -> None:
        self.running = True
        await asyncio.gather(*(self.client(k) for k in range(self.concurrency)))

    def count(self) -> int:
        return self.tokens

    def stop(self) -> int:
        self.running = False
        return self.tokens


def best_time_s(run, repeats: int) -> float:
    """The fastest of `repeats` calls of `run` (s); what `run` returns is dropped after each call,
    outside the timing (freeing object refs is not part of a put)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = run()
        times.append(time.perf_counter() - start)
        del result
    return min(times)


def pieces_per_core(dst, src, cores: int) -> list:
    """(destination, source) numpy views of `cores` about equal pieces, for `np.copyto` on one thread each."""
    step = -(-len(src) // cores)
    return [(dst[i : i + step], src[i : i + step]) for i in range(0, len(src), step)]


def raw_copy_s(nbytes: int, repeats: int = 10) -> dict[str, float]:
    """The fastest of `repeats` copies of `nbytes` (s), by torch (`torch`: `copy_` on its intra-op
    threads) and by memcpy split across every core (`memcpy`: `np.copyto` of one piece per core
    thread, which releases the GIL): a small copy takes milliseconds, and one interruption
    would double it."""
    import numpy as np

    src = torch.empty(nbytes, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    cores = os.cpu_count() or 1
    pieces = pieces_per_core(dst.numpy(), src.numpy(), cores)
    dst.copy_(src)  # touch the pages once
    with ThreadPoolExecutor(cores) as pool:
        return {
            "torch": best_time_s(lambda: dst.copy_(src), repeats),
            "memcpy": best_time_s(lambda: list(pool.map(lambda pair: np.copyto(*pair), pieces)), repeats),
        }


def warmup_syncs(model_bytes: int) -> int:
    """Syncs until a node's object store has cycled once (at least 2, at most MAX_WARMUP_SYNCS)."""
    store_bytes = max(n["Resources"].get("object_store_memory", 0) for n in ray.nodes() if n["Alive"])
    return max(2, min(MAX_WARMUP_SYNCS, -(-int(store_bytes) // max(model_bytes, 1)) + 1))


def wait_for(check, what: str, poll_s: float):
    """Call `check` every `poll_s` seconds until it returns something truthy, and return that;
    TimeoutError naming `what` after TIMEOUT_S."""
    deadline = time.time() + TIMEOUT_S
    while not (result := check()):
        if time.time() > deadline:
            raise TimeoutError(f"{what} did not happen in {TIMEOUT_S} s")
        time.sleep(poll_s)
    return result


def pipeline_sync(
    trainer, stage, version: int, bucket_bytes: int, put_threads: int, train_during=False, decoding_server=None
) -> tuple[dict, float | None]:
    """One sync through the param_update stage; with `train_during`, a training step starts as
    soon as the gather returns (as actor_train's next step does) and its seconds are returned.
    `decoding_server`: starts once it has run SETTLE_STEPS steps since its last load."""
    from async_rl.core.messages import NewWeights

    if decoding_server is not None:
        wait_for(lambda: ray.get(decoding_server.steps_since_load.remote(), timeout=TIMEOUT_S) >= SETTLE_STEPS,
                 f"{SETTLE_STEPS} rollout server steps after a load", poll_s=0.005)
    ray.get(stage.put.remote(NewWeights(version=version, started_at=time.time())), timeout=TIMEOUT_S)
    ray.get(trainer.send.remote(version, bucket_bytes, stage, put_threads), timeout=TIMEOUT_S)
    step = trainer.train_step.remote() if train_during else None
    step_s = ray.get(step, timeout=TIMEOUT_S) if step is not None else None
    timings = wait_for(lambda: ray.get(stage.pop_timings.remote(), timeout=TIMEOUT_S).get(version),
                       f"the sync of version {version}", poll_s=0.02)
    return timings, step_s


def naive_sync(trainer, server, version: int) -> dict:
    """Stop the world: abort and pause generation, gather all, put, load in full, resume."""
    start = time.perf_counter()
    ray.get(server.abort_all_requests.remote(), timeout=TIMEOUT_S)
    named_ref = ray.get(trainer.gather_all.remote(), timeout=TIMEOUT_S)
    ray.get(server.update_weights.remote(named_tensors=named_ref, version=version), timeout=TIMEOUT_S)
    ray.get(server.resume_generation.remote(), timeout=TIMEOUT_S)
    total = time.perf_counter() - start
    return {"total_s": total, "blocked_s": total}


def on_node(node_id: str) -> dict:
    """Actor options that place it on Ray node `node_id`."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}


def start_stage(server, stage_node: str, transports: list):
    """A param_update stage on `stage_node` syncing `server` through a table of `transports`."""
    from param_update.receivers import ActorReceiver
    from state_machines.param_update import ParamUpdateStage

    stage = ray.remote(ParamUpdateStage).options(max_concurrency=64, **on_node(stage_node)).remote(
        receivers=[ActorReceiver("rollout_server", server, True)], clock=VersionLog.remote(), transports=transports
    )
    ray.get(stage.connect.remote([], 1), timeout=TIMEOUT_S)
    stage.run.remote()
    return stage


def start_link(model_dir: str, consume_mb: float, node: str, stage_node: str, transports: list) -> tuple:
    """A CPU rollout server on `node`, decoding (a LoadGenerator beside it), and a param_update stage on
    `stage_node` syncing it through a table of `transports`. Returns (server, stage, load, load's run)."""
    from verl.workers.config import HFModelConfig, RolloutConfig

    config = RolloutConfig(name="cpu", tensor_model_parallel_size=1, prompt_length=8, response_length=32)
    server = ray.remote(rollout_server_class()).options(max_concurrency=64, **on_node(node)).remote(
        config=config, model_config=HFModelConfig(path=model_dir, load_tokenizer=False)
    )
    ray.get(server.launch_server.remote(), timeout=TIMEOUT_S)
    ray.get(server.configure_weight_sync.remote(True, int(consume_mb * (1 << 20))), timeout=TIMEOUT_S)
    stage = start_stage(server, stage_node, transports)
    load = LoadGenerator.options(**on_node(node)).remote(server)
    load_run = load.run.remote()
    wait_for(lambda: ray.get(load.count.remote(), timeout=TIMEOUT_S), "the first generated tokens", poll_s=0.05)
    return server, stage, load, load_run


def net_total(timings: dict) -> float:
    """A sync's total latency without the load's wait for a decoding step already running (s)."""
    return timings[TOTAL] - timings[STEP_WAIT]


def link_row(first: dict, runs: list[dict], naive: dict, raw_copy_s: float, warmup: int) -> dict:
    """One link's numbers: the best of `runs` (by total without the step wait) against the raw copy and
    the naive sync's blocked time."""
    best = min(runs, key=net_total)
    blocked = best["async/param_update/blocked_s"]
    return {
        "first_sync_s": net_total(first), "warmup_syncs": warmup, "total_s": net_total(best),
        "step_wait_s": best[STEP_WAIT], "total_with_wait_s": best[TOTAL], "blocked_s": blocked,
        "naive_total_s": naive["total_s"], "naive_blocked_s": naive["blocked_s"],
        "total_over_raw": net_total(best) / raw_copy_s, "blocked_over_naive": blocked / naive["blocked_s"],
        # a transport not in the link's table reports no count: none of its receivers read through it
        **{f"{name}_receivers": best.get(f"async/param_update/{name}_receivers", 0.0) for name in LINK_NAMES},
    }


def bench_size(size: str, bucket_mb: float, consume_mb: float, put_threads: list[int], nodes: tuple) -> dict:
    """Every measurement of one model size; `nodes`: (the trainer's node id, the other node's)."""
    from param_update.capacity import model_weight_bytes
    from param_update.transports.collective import Collective
    from param_update.transports.object_store import ObjectStore
    from param_update.transports.shared_memory import REGIONS, SharedMemory

    head, other = nodes
    trainer = Trainer.options(**on_node(head)).remote(size, seed=1, put_threads=put_threads)
    bucket_bytes = int(bucket_mb * (1 << 20))
    main_threads = put_threads[0]
    versions = iter(range(1, 1 << 30))
    with tempfile.TemporaryDirectory() as model_dir:
        ray.get(trainer.save.remote(model_dir), timeout=TIMEOUT_S)
        model_bytes = model_weight_bytes(model_dir)
        params = ray.get(trainer.num_params.remote(), timeout=TIMEOUT_S)
        # ---- same node: the server on the trainer's node, buckets through shared memory
        server, stage, load, load_run = start_link(model_dir, consume_mb, head, head, [SharedMemory, ObjectStore])
        first, _ = pipeline_sync(trainer, stage, next(versions), bucket_bytes, main_threads, decoding_server=server)
        warmup = REGIONS  # every region of the shared buffer written once
        for k in range(2, warmup + 1):
            pipeline_sync(trainer, stage, next(versions), bucket_bytes, put_threads[k % len(put_threads)],
                          decoding_server=server)
        ray.get(trainer.train_step.remote(), timeout=TIMEOUT_S)  # warm-up step
        runs: dict[int, list] = {n: [] for n in put_threads}
        training_runs: dict[int, list] = {n: [] for n in put_threads}
        alone = []
        for _ in range(3):  # interleaved: every put-thread count meets the same machine state
            for n in put_threads:
                timings, _ = pipeline_sync(trainer, stage, next(versions), bucket_bytes, n, decoding_server=server)
                runs[n].append(timings)
        for _ in range(3):
            alone.append(ray.get(trainer.train_step.remote(), timeout=TIMEOUT_S))
            for n in put_threads:
                training_runs[n].append(pipeline_sync(
                    trainer, stage, next(versions), bucket_bytes, n, train_during=True, decoding_server=server
                ))
        alone_s = statistics.median(alone)
        raw_copy_decoding = min(ray.get(trainer.raw_copy_s.remote(model_bytes), timeout=TIMEOUT_S).values())
        naive_sync(trainer, server, next(versions))  # warm-up of the naive path
        naive = min((naive_sync(trainer, server, next(versions)) for _ in range(2)), key=lambda r: r["total_s"])
        tokens = ray.get(load.stop.remote(), timeout=TIMEOUT_S)
        ray.get(load_run, timeout=TIMEOUT_S)  # raises if the generation load failed
        idle = [pipeline_sync(trainer, stage, next(versions), bucket_bytes, main_threads)[0] for _ in range(3)]
        raw_beside_idle = raw_copy_s(model_bytes)  # the same machine state as the idle syncs
        for actor in (stage, server, load):
            ray.kill(actor, no_restart=True)
        ray.get(trainer.close.remote(), timeout=TIMEOUT_S)  # the shared buffer's memory goes back
        # ---- other node: the server on the second node, buckets through Ray's object store
        server, stage, load, load_run = start_link(model_dir, consume_mb, other, head, [SharedMemory, ObjectStore])
        cross_first, _ = pipeline_sync(trainer, stage, next(versions), bucket_bytes, main_threads,
                                       decoding_server=server)
        cross_warmup = warmup_syncs(model_bytes)  # until the stores have cycled once
        for _ in range(2, cross_warmup + 1):
            pipeline_sync(trainer, stage, next(versions), bucket_bytes, main_threads, decoding_server=server)
        cross = [pipeline_sync(trainer, stage, next(versions), bucket_bytes, main_threads,
                               decoding_server=server)[0] for _ in range(3)]
        naive_sync(trainer, server, next(versions))
        cross_naive = min((naive_sync(trainer, server, next(versions)) for _ in range(2)), key=lambda r: r["total_s"])
        # ---- the same server through the collective transport (a stage whose table has it)
        ray.kill(stage, no_restart=True)
        stage = start_stage(server, head, [SharedMemory, Collective, ObjectStore])
        group_first, _ = pipeline_sync(trainer, stage, next(versions), bucket_bytes, main_threads,
                                       decoding_server=server)
        for _ in range(2, REGIONS + 1):  # every region of the sender's buffer written once
            pipeline_sync(trainer, stage, next(versions), bucket_bytes, main_threads, decoding_server=server)
        group = [pipeline_sync(trainer, stage, next(versions), bucket_bytes, main_threads,
                               decoding_server=server)[0] for _ in range(3)]
        ray.get(load.stop.remote(), timeout=TIMEOUT_S)
        ray.get(load_run, timeout=TIMEOUT_S)
        group_idle = [pipeline_sync(trainer, stage, next(versions), bucket_bytes, main_threads)[0] for _ in range(3)]
        probe = LinkProbe.options(**on_node(other)).remote()
        raw_link = ray.get(trainer.raw_link_s.remote(model_bytes, probe), timeout=TIMEOUT_S)
        ray.get(trainer.close.remote(), timeout=TIMEOUT_S)
        for actor in (stage, server, load, trainer, probe):
            ray.kill(actor, no_restart=True)
    by_threads = {}
    for n in put_threads:
        best = min(runs[n], key=net_total)
        by_threads[n] = {
            "pipeline_total_s": net_total(best),
            "pipeline_step_wait_s": best[STEP_WAIT],
            "pipeline_blocked_s": best["async/param_update/blocked_s"],
            "pipeline_total_training_s": statistics.median(net_total(t) for t, _ in training_runs[n]),
            "train_step_slowdown": statistics.median(step for _, step in training_runs[n]) / alone_s,
            "parts_s": {k.rsplit("/", 1)[-1]: v for k, v in best.items() if k.startswith("timing_s/")},
        }
    main = by_threads[main_threads]
    raw_copy = {way: min(t, raw_beside_idle[way]) for way, t in raw_copy_s(model_bytes).items()}  # the faster
    raw = min(raw_copy.values())
    return {
        "size": size,
        "params": params,
        "model_mb": model_bytes / (1 << 20),
        "put_threads": main_threads,
        "pipeline_total_s": main["pipeline_total_s"],
        "pipeline_step_wait_s": main["pipeline_step_wait_s"],
        "pipeline_blocked_s": main["pipeline_blocked_s"],
        "pipeline_first_sync_s": net_total(first),
        "pipeline_total_training_s": main["pipeline_total_training_s"],
        "pipeline_total_idle_s": min(net_total(t) for t in idle),
        "warmup_syncs": warmup,
        "naive_total_s": naive["total_s"],
        "naive_blocked_s": naive["blocked_s"],
        "raw_copy_s": raw,
        "raw_copy_torch_s": raw_copy["torch"],
        "raw_copy_decoding_s": raw_copy_decoding,
        "train_step_slowdown": main["train_step_slowdown"],
        "train_step_alone_s": alone_s,
        "parts_s": main["parts_s"],
        "by_put_threads": by_threads,
        "tokens_generated": tokens,
        "raw_link_s": raw_link,
        "links": {
            "same_node": link_row(first, runs[main_threads], naive, raw, warmup),
            "other_node": link_row(cross_first, cross, cross_naive, raw, cross_warmup),
            "other_node_collective": {
                **link_row(group_first, group, cross_naive, raw, REGIONS),
                "total_idle_s": min(net_total(t) for t in group_idle),
                "idle_over_raw_link": min(net_total(t) for t in group_idle) / raw_link,
                "total_over_raw_link": min(net_total(t) for t in group) / raw_link,
            },
        },
    }


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10M,100M,500M", help=f"comma-separated, of {list(SIZES)}")
    parser.add_argument("--bucket-mb", type=float, default=512.0, help="preduce bucket size, MB (the pipeline default)")
    parser.add_argument("--consume-mb", type=float, default=128.0, help="consume bucket size, MB (the pipeline default)")
    parser.add_argument("--put-threads", default=f"{PUT_THREADS},1",
                        help="comma-separated put-thread counts run in turn; the first is the main table's")
    parser.add_argument("--json", help="write the rows as a JSON list here")
    args = parser.parse_args(argv)
    put_threads = [int(n) for n in args.put_threads.split(",")]
    command = command_line()
    cluster = two_node_cluster()
    nodes = node_ids(cluster)
    rows = []
    try:
        for size in args.sizes.split(","):
            rows.append(bench_size(size.strip(), args.bucket_mb, args.consume_mb, put_threads, nodes))
            print(f"done {size}: {json.dumps(rows[-1])}", flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
    header = (f"{'size':>5} {'params':>11} {'MB':>7} | {'first sync':>10} {'pipe total':>10} {'step wait':>9} "
              f"{'pipe blocked':>12} {'w/ train':>9} | "
              f"{'naive total':>11} {'naive blocked':>13} | {'raw copy':>8} {'torch':>8} {'decoding':>8} "
              f"{'blocked ratio':>13} {'total/raw':>9} | {'train slowdown':>14}")
    print(f"\ncommand: {command}\ncpus: {os.cpu_count()}, torch {torch.__version__}, buckets {args.bucket_mb:g} MB "
          f"(preduce) / {args.consume_mb:g} MB (consume), dual buffer on, {put_threads[0]} put threads")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['size']:>5} {r['params']:>11,} {r['model_mb']:>7.0f} | {r['pipeline_first_sync_s']:>9.3f}s "
              f"{r['pipeline_total_s']:>9.3f}s {r['pipeline_step_wait_s']:>8.3f}s {r['pipeline_blocked_s']:>11.4f}s "
              f"{r['pipeline_total_training_s']:>8.3f}s | "
              f"{r['naive_total_s']:>10.3f}s {r['naive_blocked_s']:>12.3f}s | "
              f"{r['raw_copy_s']:>7.4f}s {r['raw_copy_torch_s']:>7.4f}s {r['raw_copy_decoding_s']:>7.4f}s "
              "| "
              f"{r['pipeline_blocked_s'] / r['naive_blocked_s']:>13.4f} "
              f"{r['pipeline_total_s'] / r['raw_copy_s']:>9.2f} | {r['train_step_slowdown']:>13.2f}x")
    print("goal: blocked ratio <= 0.1 (pipeline vs naive), total/raw <= 2.0; 'raw copy': the faster of torch's "
          "copy_ ('torch') and memcpy on every core (the faster of two measurements); 'pipe': the server on the trainer's node (shared memory); 'first sync': cold pages; "
          "'pipe total/blocked': after both shared-memory regions were written once, generation decoding; "
          "'step wait': the load's wait for the decoding step running when the weights were ready (the engine "
          "swaps between steps; not in any total); 'w/ train': the same with a "
          "training step beside it (median); 'decoding': the raw copy in the trainer process while the "
          "rollout server decodes, as the pipeline's syncs run")
    link_header = (f"{'size':>5} {'link':<30} | {'shm/coll/store':>14} {'first sync':>10} {'total':>8} "
                   f"{'step wait':>9} {'blocked':>8} {'naive blocked':>13} | {'total/raw':>9} {'blocked/naive':>13}")
    print(f"\nper link (a server on the trainer's Ray node, then one on the other node), generation decoding:\n"
          f"{link_header}\n{'-' * len(link_header)}")
    names = {"same_node": "same node (shared memory)", "other_node": "other node (object store)",
             "other_node_collective": "other node (collective, gloo)"}
    for r in rows:
        for name, link in r["links"].items():
            counts = "/".join(f"{link[f'{n}_receivers']:.0f}" for n in LINK_NAMES)
            print(f"{r['size']:>5} {names[name]:<30} | {counts:>14} "
                  f"{link['first_sync_s']:>9.3f}s {link['total_s']:>7.3f}s {link['step_wait_s']:>8.3f}s "
                  f"{link['blocked_s']:>7.4f}s {link['naive_blocked_s']:>12.3f}s | {link['total_over_raw']:>9.2f} "
                  f"{link['blocked_over_naive']:>13.4f}")
    print("goal: total/raw <= 2.0 on the same node, blocked/naive <= 0.1; 'total': gather start to loaded, "
          "without the step wait; 'naive blocked': the stop-the-world sync of the same server; "
          "'shm/coll/store': receivers that got the version through shared memory / the collective / the object store")
    print("\nacross nodes, the collective against the link it uses (gloo, the bytes sent once to the other node):")
    for r in rows:
        link = r["links"]["other_node_collective"]
        store = r["links"]["other_node"]
        print(f"{r['size']}: raw link {r['raw_link_s']:.3f}s; collective sync {link['total_s']:.3f}s decoding "
              f"({link['total_over_raw_link']:.2f}x the raw link), {link['total_idle_s']:.3f}s idle "
              f"({link['idle_over_raw_link']:.2f}x), object store {store['total_s']:.3f}s "
              f"({store['total_s'] / r['raw_link_s']:.2f}x); generation blocked {link['blocked_s']:.4f}s = "
              f"{link['blocked_over_naive']:.4f} of the naive sync's {link['naive_blocked_s']:.3f}s")
    print("goal across nodes: the whole sync <= 3x the raw link, generation blocked <= 0.01 of the naive sync")
    for r in rows:
        parts = ", ".join(f"{k} {v:.3f}s" for k, v in r["parts_s"].items())
        print(f"{r['size']}: pipeline parts: {parts}")
    print("\nno decoding (the rollout server idle, as the raw copy ran; the goal's row): "
          + ", ".join(f"{r['size']} pipe total {r['pipeline_total_idle_s']:.3f}s = "
                      f"{r['pipeline_total_idle_s'] / r['raw_copy_s']:.2f}x raw copy" for r in rows))
    print(f"\nput threads (syncs interleaved): {'size':>5} {'threads':>7} | {'pipe total':>10} {'gather':>7} "
          f"{'w/ train':>9} {'total/raw':>9} {'train slowdown':>14}")
    for r in rows:
        for n, t in r["by_put_threads"].items():
            print(f"{'':>32}{r['size']:>5} {n:>7} | {t['pipeline_total_s']:>9.3f}s {t['parts_s']['gather']:>6.3f}s "
                  f"{t['pipeline_total_training_s']:>8.3f}s {t['pipeline_total_s'] / r['raw_copy_s']:>9.2f} "
                  f"{t['train_step_slowdown']:>13.2f}x")
    if args.json:
        keys = ("params", "pipeline_total_s", "pipeline_blocked_s", "naive_total_s", "naive_blocked_s",
                "raw_copy_s", "train_step_slowdown", "pipeline_first_sync_s", "pipeline_total_training_s",
                "warmup_syncs", "raw_copy_torch_s", "raw_copy_decoding_s", "put_threads",
                "by_put_threads", "pipeline_total_idle_s", "pipeline_step_wait_s", "raw_link_s", "links")
        with open(args.json, "w") as f:
            json.dump([{"size": r["size"], **{k: r[k] for k in keys}} for r in rows], f, indent=1)
    return rows


if __name__ == "__main__":
    main()
