"""GPU check of the weight path without Ray or vLLM: a training step under torch's FSDP2, then the sync's
device parts between two processes, at Qwen2-shaped sizes built locally (random init, no model hub).

    python bench/gpu_check.py --device cuda --sizes 0.5B,1.5B,7B
    python bench/gpu_check.py --device cpu --sizes tiny          # what CI runs (tests/param_update/test_gpu_check.py)

First a delta check: versions 1 and 2 of three tensors through `param_update.delta` (a bf16 rollout of a float32
trainer), staged and loaded on the device, where the delta is put together (exit 1 unless bit for bit).

Per size, two spawned processes, and per version (`--versions`, 3):
- trainer: a Qwen2ForCausalLM wrapped in `fully_shard` (one rank), one AdamW step on random tokens, then
  **gather** (packed by `param_update.buckets.pack_buckets` on the device) and **send** (each bucket copied
  into one of `--send-buffers` (2) transport buffers, handed over a torch.multiprocessing queue: CUDA IPC on
  a GPU, shared memory on the CPU; a buffer is reused once the receiver has staged its bucket).
- receiver: **recv** (open the handle) and **register-buffer** (`param_update.staging.VersionStager`
  with `device=` the GPU: one device copy per bucket), then **load** into an HF model on the device.
Then the trainer compares every tensor the receiver loaded with its own, byte for byte (exit 1 on a mismatch),
and prints each version's sync, the last version's parts and the first version's sync against the last.

Choices (each printed with the run's parts):
- `--gather tensor` (verl's FSDP2 engine: each parameter's `full_tensor()`), `module` (each FSDP module
  unshard()ed, one all-gather per module) or `local` (each parameter's shard, which on one rank is the whole
  tensor: what remains of the sync when no other rank holds a part);
- `--send ring` (as above) or `region` (the two-pass path: each bucket written once into the version's region,
  one of two sets of buffers, and the receiver stages views of it, no copy; with `--load swap` its weights then
  live in the trainer's region, which is written again two versions later, once they stopped serving: the
  receiver checks they stayed unchanged while the next version arrived, exit 1 otherwise);
- `--load copy` (`copy_into`: the bytes go into the live weights, as into a GPU engine) or `swap` (`swap_into`,
  the dual buffer: the staged tensors become the weights, zero copy).

Neither Ray nor verl is imported, so this check runs on any CUDA PyTorch machine; verl's FSDP2 engine through the
pipeline's worker, which needs both (`import verl` imports Ray), is bench/gpu_worker_step.py. The gather here is
what verl's FSDP2 engine does per tensor (`full_tensor()` of each sharded parameter).

Prints per part seconds and GB/s (model bytes / seconds) against the device's own copy (device to device on a
GPU, memcpy on the CPU) and, on a GPU, the pinned host-to-device copy, each the best of five copies of 1 GiB
(256 MiB on the CPU).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from async_rl.api.weights import Bucket  # noqa: E402
from bench.command import command_line  # noqa: E402
from param_update.buckets import pack_buckets, tensor_bytes  # noqa: E402
from param_update.staging import VersionStager, weight_layout  # noqa: E402

GB = 1e9
QUEUE_TIMEOUT_S = 300  # one bucket, or one 7B model build, never takes this long; a dead peer ends the run
# Qwen2.5 shapes (hidden, intermediate, layers, heads, kv heads, vocab, tied embeddings)
SIZES = {
    "tiny": (64, 128, 2, 4, 2, 512, True),
    "0.5B": (896, 4864, 24, 14, 2, 151936, True),
    "1.5B": (1536, 8960, 28, 12, 2, 151936, True),
    "7B": (3584, 18944, 28, 28, 4, 152064, False),
}
PARTS = ("gather", "send", "recv", "register", "load")
GATHERS = ("tensor", "module", "local")
LOADS = ("copy", "swap")
SENDS = ("ring", "region")
REGIONS = 2  # --send region: version v is written into region v % 2 (the other one serves v - 1)
CHECKS = "checks"  # the receiver's seconds in the kit's own checks, inside the trainer's wait: not the sync's
COPY_BYTES = {"cuda": 1 << 30, "cpu": 1 << 28}  # the reference copies' size per device (copy_rates)


def qwen2(size: str, device: str, seed: int):
    """A random-init Qwen2ForCausalLM of `size` in bf16 on `device`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden, inter, layers, heads, kv, vocab, tied = SIZES[size]
    config = Qwen2Config(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                         tie_word_embeddings=tied, max_position_embeddings=4096)
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16 (a 7B model never exists in float32)
    try:
        with torch.device(device):
            return Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(default)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def copy_rates(device: str, nbytes: int) -> dict[str, float]:
    """GB/s of the device's own copy and (GPU) the pinned host-to-device copy of `nbytes`, best of five."""
    def best(dst, src):
        times = []
        for _ in range(5):
            sync(device)
            start = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            sync(device)
            times.append(time.perf_counter() - start)
        return nbytes / min(times) / GB

    src, dst = torch.ones(nbytes, dtype=torch.uint8, device=device), torch.empty(nbytes, dtype=torch.uint8, device=device)
    rates = {"device copy": best(dst, src)}
    if device == "cuda":
        rates["pinned host copy"] = best(dst, torch.ones(nbytes, dtype=torch.uint8).pin_memory())
    return rates


def shared_buffer(nbytes: int, device: str) -> torch.Tensor:
    """`nbytes` uint8 on `device` that a torch.multiprocessing queue hands over without a copy: CUDA IPC on a GPU,
    shared memory on the CPU."""
    buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return buffer.share_memory_() if device == "cpu" else buffer


def local_tensors(model):
    """(name, parameter) with each parameter as its local shard, which on a one-rank mesh is the whole tensor:
    no gather, no copy. Refuses a parameter whose shard is not the whole tensor."""
    for name, param in model.named_parameters():
        local = param.to_local()
        if local.shape != param.shape:
            raise SystemExit(f"--gather local needs one rank: {name}'s shard is {tuple(local.shape)} "
                             f"of {tuple(param.shape)}")
        yield name, local.detach()


def trainer(size: str, device: str, bucket_bytes: int, port: int, to_recv, to_train, save_dir: str | None,
            gather: str, load: str, versions: int, ring: int, send: str) -> None:
    """Per version: one AdamW step under FSDP2, then gather and send the weights in buckets, then check the
    receiver's loaded weights byte for byte; then print each version's total and the last version's parts."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1)
    model = qwen2(size, device, seed=1)
    mesh = init_device_mesh(device, (1,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    fsdp_modules = [*model.model.layers, model]
    if gather == "module":  # one all-gather per module: its parameters are plain full tensors until reshard()
        full = lambda: ((n, p.detach()) for n, p in model.named_parameters())  # noqa: E731
    elif gather == "local":  # one rank: each shard is its whole tensor
        full = lambda: local_tensors(model)  # noqa: E731
    else:  # verl's FSDP2 engine's per-tensor gather
        full = lambda: ((n, p.full_tensor()) for n, p in model.named_parameters())  # noqa: E731
    if save_dir:
        torch.save({n: p.full_tensor().cpu() for n, p in model.named_parameters()}, os.path.join(save_dir, "before.pt"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, model.config.vocab_size, (2, 128 if device == "cuda" else 16), device=device)
    buffers = [shared_buffer(bucket_bytes, device) for _ in range(ring)] if send == "ring" else []
    # --send region: region -> bucket index -> its buffer, made at the first version written there. The trainer
    # starts version v once the receiver loaded v - 1, so nothing reads or serves v - 2, which region v % 2 held.
    regions: list[dict[int, torch.Tensor]] = [{} for _ in range(REGIONS)]
    assert to_train.get(timeout=QUEUE_TIMEOUT_S) == "ready"
    totals, parts = [], {}
    for version in range(1, versions + 1):
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        seconds, count, nbytes = {"gather": 0.0, "send": 0.0}, 0, 0
        start = time.perf_counter()
        if gather == "module":
            for module in fsdp_modules:
                module.unshard()
        buckets = pack_buckets(full(), bucket_bytes, version=version, device=None)
        while True:
            t0 = time.perf_counter()
            bucket = next(buckets, None)
            sync(device)
            t1 = time.perf_counter()
            seconds["gather"] += t1 - t0
            if bucket is None:
                break
            if send == "region":
                region = regions[version % REGIONS]
                if count not in region or region[count].numel() < bucket.nbytes:
                    region[count] = shared_buffer(bucket.nbytes, device)
                buffer = region[count]
            else:
                if count >= ring:  # the buffer's previous bucket must be staged before it is overwritten
                    assert to_train.get(timeout=QUEUE_TIMEOUT_S) == ("staged", version, count - ring)
                buffer = buffers[count % ring]
            offsets, at = [], 0
            for array in bucket.data:
                n = len(array)
                buffer[at:at + n].copy_(torch.as_tensor(array))
                offsets.append((at, n))
                at += n
            sync(device)
            to_recv.put(("bucket", version, count, buffer, offsets, bucket.slices, time.monotonic()))
            seconds["send"] += time.perf_counter() - t1
            nbytes += bucket.nbytes
            count += 1
        del bucket, buckets
        to_recv.put(("end", version, count))
        message = to_train.get(timeout=QUEUE_TIMEOUT_S)
        while message[0] == "staged":  # acks of the last buckets
            message = to_train.get(timeout=QUEUE_TIMEOUT_S)
        _, receiver_seconds, loaded = message
        totals.append(time.perf_counter() - start - receiver_seconds.pop(CHECKS))
        seconds.update(receiver_seconds)
        differ, missing, after = [], [], {}
        for n, t in full():  # one gathered tensor at a time
            if n not in loaded:
                missing.append(n)
            elif not tensor_bytes(t).equal(tensor_bytes(loaded[n])):
                differ.append(n)
            if save_dir and version == versions:
                after[n] = t.to("cpu", copy=True)  # the unsharded tensor is freed at reshard()
        extra = sorted(set(loaded) - {n for n, _ in model.named_parameters()})
        compared = len(loaded)
        del loaded, message
        to_recv.put("checked")
        if gather == "module":
            for module in fsdp_modules:
                module.reshard()
        print(f"[{size}] version {version}: loss {loss.item():.4f}, sync {totals[-1]:.3f} s, "
              + ", ".join(f"{part} {seconds[part]:.3f}" for part in PARTS), flush=True)
        if differ or missing or extra:
            print(f"[{size}] bitwise: {len(differ)} of {compared} tensors differ, {len(missing)} never loaded, "
                  f"{len(extra)} not the trainer's", flush=True)
            raise SystemExit(f"[{size}] version {version}: loaded weights differ from the trainer's: "
                             f"{(differ + missing + extra)[:5]}")
        parts = seconds
    to_recv.put("done")
    if save_dir:
        torch.save(after, os.path.join(save_dir, "after.pt"))
    copy_bytes = COPY_BYTES[device]
    rates = copy_rates(device, copy_bytes)
    through = f"through {ring} send buffers" if send == "ring" else f"into {REGIONS} regions"
    print(f"[{size}] {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, {nbytes / 2**20:.2f} MiB "
          f"in {count} buckets of {bucket_bytes / 2**20:.2f} MiB {through}, {device}, gather {gather}, "
          f"load {load}; version {versions} of {versions}:", flush=True)
    for part in PARTS:
        rate = nbytes / parts[part] / GB
        against = ", ".join(f"{rate / r:.3f} x {name}" for name, r in rates.items())
        print(f"[{size}] {part:9s} {parts[part]:8.3f} s  {rate:8.2f} GB/s  ({against})", flush=True)
    rate = nbytes / totals[-1] / GB
    against = ", ".join(f"{rate / r:.3f} x {name}" for name, r in rates.items())
    print(f"[{size}] total     {totals[-1]:8.3f} s  {rate:8.2f} GB/s  ({against}; gather start to loaded, parts overlap)",
          flush=True)
    if versions > 1:
        first = nbytes / totals[0] / GB
        print(f"[{size}] version 1's total {totals[0]:.3f} s, {first:.2f} GB/s ({first / rates['device copy']:.3f} x "
              f"device copy), {totals[0] / totals[-1]:.1f}x version {versions}'s", flush=True)
    for name, r in rates.items():
        print(f"[{size}] {name}: {r:.2f} GB/s ({copy_bytes / 2**20:.0f} MiB, best of 5)", flush=True)
    print(f"[{size}] bitwise: 0 of {compared} tensors differ in each of {versions} versions, 0 never loaded, "
          f"0 not the trainer's", flush=True)
    dist.destroy_process_group()
    check_no_ray("trainer")


def receiver(size: str, device: str, consume_bytes: int, to_recv, to_train, save_dir: str | None, load: str,
             send: str) -> None:
    """Per version: stage each bucket (ring: copied into a device buffer; region: zero-copy views of the trainer's
    region), load the version into an HF model (copy or swap), hand the loaded tensors back for the check."""
    model = qwen2(size, device, seed=2)
    expected, aliases, params = weight_layout(model.state_dict())
    stager = VersionStager(expected, aliases, device=device if send == "ring" else None)
    serving = None  # --send region --load swap: a fingerprint of the weights, which live in the trainer's region
    to_train.put("ready")
    while (message := to_recv.get(timeout=QUEUE_TIMEOUT_S)) != "done":
        seconds = {"recv": 0.0, "register": 0.0, "load": 0.0, CHECKS: 0.0}
        received = []  # --send region: the buffers this version arrived in
        t0 = time.monotonic()
        while message[0] == "bucket":
            _, version, index, buffer, offsets, slices, sent_at = message
            t1 = time.monotonic()
            if send == "region":
                received.append(buffer)
            stager.stage(version, Bucket(version, index, [buffer[at:at + n] for at, n in offsets], slices))
            sync(device)
            t2 = time.monotonic()
            del buffer, message
            to_train.put(("staged", version, index))
            seconds["recv"] += t1 - max(t0, sent_at)  # from the put (or our get, if later) to the bucket's handle open
            seconds["register"] += t2 - t1
            t0 = time.monotonic()
            message = to_recv.get(timeout=QUEUE_TIMEOUT_S)
        _, version, count = message
        if serving is not None:  # the version arrived without writing over the region the weights serve from
            t1 = time.perf_counter()
            if fingerprint(params) != serving:
                raise SystemExit(f"[{size}] version {version - 1}'s weights changed while version {version} arrived")
            seconds[CHECKS] += time.perf_counter() - t1
        stager.check_complete(version, count)
        t0 = time.perf_counter()
        if load == "swap":
            stager.swap_into(params)
        else:
            stager.copy_into(params, consume_bytes)
        sync(device)
        seconds["load"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        if send == "region" and load == "swap":
            serving = fingerprint(params)
            print(f"[{size}] version {version}: {served_from(params, received)} of {len(params)} weights serve from "
                  f"the trainer's region, zero copy (a tensor split across buckets is put together)", flush=True)
        if save_dir:
            torch.save({n: t.detach().cpu() for n, t in params.items()}, os.path.join(save_dir, "receiver.pt"))
        # handed back for the check; a view of the trainer's region goes back as a copy (a tensor opened through
        # CUDA IPC cannot be shared again)
        loaded = {n: t.detach().clone() if send == "region" else t.detach() for n, t in params.items()}
        del received
        sync(device)
        seconds[CHECKS] += time.perf_counter() - t1
        to_train.put(("loaded", seconds, loaded))
        del loaded
        assert to_recv.get(timeout=QUEUE_TIMEOUT_S) == "checked"  # the trainer read our tensors
    check_no_ray("receiver")


def fingerprint(params: dict[str, torch.Tensor]) -> list[int]:
    """Each tensor's bytes summed: a change of the bytes (a version written over them) changes it."""
    return torch.stack([tensor_bytes(t).sum(dtype=torch.int64) for t in params.values()]).tolist()


def served_from(params: dict[str, torch.Tensor], buffers: list[torch.Tensor]) -> int:
    """How many of `params` lie inside one of `buffers` (views of it)."""
    spans = [(b.data_ptr(), b.data_ptr() + b.numel()) for b in buffers]
    return sum(any(lo <= p.data_ptr() and p.data_ptr() + p.nbytes <= hi for lo, hi in spans) for p in params.values())


def check_delta(device: str) -> bool:
    """Versions 1 (whole) and 2 (a delta: 2 % of the values moved) of three float32 tensors, sent as a bf16
    rollout holds them, staged and loaded on `device` (the delta put together there); prints and returns whether
    the loaded bytes are version 2's cast to bf16, bit for bit."""
    from param_update.delta import DeltaEncoder, as_held

    g = torch.Generator().manual_seed(0)
    trained = {f"w{i}": torch.randn(n, generator=g) for i, n in enumerate((5, 70_000, 300_000))}
    encoder = DeltaEncoder({name: torch.bfloat16 for name in trained})
    stager = VersionStager({name: (torch.bfloat16, tuple(t.shape)) for name, t in trained.items()}, device=device)
    params = {name: torch.zeros(t.shape, dtype=torch.bfloat16, device=device) for name, t in trained.items()}
    for version, base in ((1, None), (2, 1)):
        if base is not None:
            trained = {name: t + (torch.rand(t.shape, generator=g) < 0.02) * 0.05 for name, t in trained.items()}
        buckets = list(pack_buckets(encoder.encode(trained.items(), version, base), 1 << 16, version))
        for bucket in buckets:
            stager.stage(version, bucket)
        stager.check_complete(version, len(buckets))
        stager.copy_into(params, 1 << 20)
    same = all(tensor_bytes(params[name].cpu()).equal(tensor_bytes(as_held(t, torch.bfloat16)))
               for name, t in trained.items())
    print(f"delta put together on {device}: version 2 loaded bit for bit: {same} "
          f"({sum(s.nbytes for b in buckets for s in b.slices)} bytes sent of "
          f"{sum(t.numel() * 2 for t in trained.values())})", flush=True)
    return same


def check_no_ray(process: str) -> None:
    """Exit 1 if this process imported Ray, vLLM or verl: the kit must run where they are not installed."""
    loaded = [name for name in ("ray", "vllm", "verl") if name in sys.modules]
    print(f"{process} imported none of ray, vllm, verl: {not loaded}", flush=True)
    if loaded:
        raise SystemExit(f"{process} imported {loaded}, which a bare CUDA PyTorch machine does not have")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_checked(parser: argparse.ArgumentParser) -> tuple[argparse.Namespace, list[str]]:
    """The arguments, and `--sizes` as a list; a parser error for a size not in SIZES, or `--device cuda`
    where torch sees no GPU."""
    args = parser.parse_args()
    sizes = args.sizes.split(",")
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        parser.error(f"unknown sizes {unknown}; known: {list(SIZES)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no GPU (torch.cuda.is_available() is False)")
    return args, sizes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--sizes", default="0.5B,1.5B,7B", help=f"comma-separated, of {','.join(SIZES)}")
    parser.add_argument("--bucket-mb", type=float, default=512, help="gather / send bucket (MiB)")
    parser.add_argument("--consume-mb", type=float, default=128, help="load group (MiB)")
    parser.add_argument("--gather", choices=GATHERS, default="tensor",
                        help="tensor: each parameter's full_tensor() (verl's); module: one all-gather per FSDP module; "
                             "local: each parameter's shard, the whole tensor on one rank (no gather)")
    parser.add_argument("--load", choices=LOADS, default="copy",
                        help="copy into the live weights (copy_into), or swap the staged tensors in (swap_into)")
    parser.add_argument("--send", choices=SENDS, default="ring",
                        help="ring: each bucket copied into a send buffer, then into the receiver's device buffer; "
                             f"region: written once into the version's region ({REGIONS}), whose views the receiver "
                             "stages and serves")
    parser.add_argument("--send-buffers", type=int, default=2,
                        help="--send ring: the trainer's send buffers (a bucket each), reused once the receiver "
                             "staged their bucket")
    parser.add_argument("--versions", type=int, default=3,
                        help="versions synced per size, a training step before each; the last one's parts are printed")
    parser.add_argument("--save-dir", help="write before.pt / after.pt (trainer) and receiver.pt there")
    args, sizes = parse_checked(parser)
    print(command_line(), flush=True)
    print(f"torch {torch.__version__}" + (f", {torch.cuda.get_device_name()}" if args.device == "cuda" else ""), flush=True)
    if not check_delta(args.device):
        return 1
    ctx = mp.get_context("spawn")
    for size in sizes:
        to_recv, to_train = ctx.Queue(), ctx.Queue()
        procs = [ctx.Process(target=trainer, args=(size, args.device, int(args.bucket_mb * 2**20), free_port(),
                                                   to_recv, to_train, args.save_dir, args.gather, args.load,
                                                   args.versions, args.send_buffers, args.send)),
                 ctx.Process(target=receiver, args=(size, args.device, int(args.consume_mb * 2**20), to_recv,
                                                    to_train, args.save_dir, args.load, args.send))]
        for p in procs:
            p.start()
        while any(p.is_alive() for p in procs):  # one failing ends the other (no wait for its queue timeout)
            if any(p.exitcode for p in procs):
                for p in procs:
                    p.terminate()
            time.sleep(0.2)
        codes = [p.exitcode for p in procs]
        if any(codes):
            print(f"[{size}] FAILED: trainer exit {codes[0]}, receiver exit {codes[1]}", flush=True)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
