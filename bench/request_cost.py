"""Benchmark: what a request costs the CPU rollout server, sent one by one as verl's agent loop sends a step's
requests, or all at once as the pipeline's generate stage does; and what the same calls cost a Ray actor
that does nothing.

One CPU rollout server of the copy demo's model (`async_rl.demo.prepare`) as a Ray actor. A round sends
`--requests` of the demo's prompts (256: one step of the demo, 32 prompts x 8) with the demo's sampling
(`max_tokens` 4) through `server.generate.remote`, as verl's `LLMServerClient.generate` does, either all at
once (`burst`) or one every `--gap-ms` (`paced`; 2.1 ms is the median gap bench/step_parts.py measured
between the requests of verl's V1 agent-loop worker). The server runs with the engine's admission window
0 and `--window-ms`. The same rounds go to an async Ray actor whose `generate` returns at once: what Ray's
call alone costs the receiving process.

Per case, medians over `--rounds` rounds (cases alternate within a round): the receiving process's CPU a
request (ms, `time.process_time`: every thread of it), split into the engine's forwards (the CPU of the
thread that runs each) and the rest (request handling, the event loop, Ray's receiving and replying);
forwards a round.

    python bench/request_cost.py [--requests 256] [--gap-ms 2.1] [--window-ms 300] [--rounds 7] [--json PATH]
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
from pathlib import Path

import ray

# this folder holds a module named like the `param_update` package (Ray's workers, too, put it first on their path
# when the driver's path holds it): the repository root comes first
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.command import command_line  # noqa: E402
from bench.demo_prompts import demo_prompts  # noqa: E402

TIMEOUT_S = 300
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": 0}
PATTERNS = ("burst", "paced")


def measured_server_class():
    """The CPU rollout server, counting its engine's forwards and the CPU of the threads that ran them."""
    from async_rl.rollout.cpu.server import CPURolloutServer

    class MeasuredServer(CPURolloutServer):
        async def launch_server(self, *args, **kwargs) -> None:
            await super().launch_server(*args, **kwargs)
            forward = self.engine._forward
            self._forwards, self._forward_cpu_s = 0, 0.0

            def counted(*forward_args):
                start = time.thread_time()
                try:
                    return forward(*forward_args)
                finally:
                    self._forwards += 1
                    self._forward_cpu_s += time.thread_time() - start

            self.engine._forward = counted

        def cpu(self) -> tuple[float, float, int]:
            """(the process's CPU s, the forwards' CPU s, forwards) so far."""
            return time.process_time(), self._forward_cpu_s, self._forwards

    return MeasuredServer


class EmptyServer:
    """A Ray actor with the server's `generate` signature that returns at once."""

    async def generate(self, prompt_ids, sampling_params, request_id, image_data=None, video_data=None):
        await asyncio.sleep(0)
        return {"token_ids": [], "log_probs": []}

    def cpu(self) -> tuple[float, float, int]:
        return time.process_time(), 0.0, 0


def start_server(demo_dir: Path, window_ms: float):
    from verl.workers.config import HFModelConfig, RolloutConfig

    config = RolloutConfig(name="cpu", tensor_model_parallel_size=1, prompt_length=16, response_length=4,
                           engine_kwargs={"cpu": {"admission_window_ms": window_ms}})
    server = ray.remote(measured_server_class()).options(max_concurrency=1000, num_cpus=0).remote(
        config=config, model_config=HFModelConfig(path=str(demo_dir / "model"), load_tokenizer=False))
    ray.get(server.launch_server.remote(), timeout=TIMEOUT_S)
    return server


class Client:
    """An async Ray actor sending as verl's agent-loop worker does: each request a task awaiting
    `server.generate.remote`."""

    async def send_round(self, server, prompts: list[list[int]], gap_s: float, tag: str) -> dict:
        """One round to `server`: its CPU a request (ms), split, its forwards, and the tokens generated."""
        loop = asyncio.get_running_loop()
        before = await server.cpu.remote()
        start = loop.time()

        async def one(i: int, prompt: list[int]):
            await asyncio.sleep(max(0.0, start + i * gap_s - loop.time()))
            return await server.generate.remote(prompt_ids=prompt, sampling_params=dict(SAMPLING, max_tokens=4),
                                                request_id=f"{tag}-{i}", image_data=None, video_data=None)

        outputs = await asyncio.gather(*(one(i, prompt) for i, prompt in enumerate(prompts)))
        after = await server.cpu.remote()
        process_s, forwards_s = after[0] - before[0], after[1] - before[1]
        tokens = sum(len(out["token_ids"] if isinstance(out, dict) else out.token_ids) for out in outputs)
        return {"cpu_ms": process_s / len(prompts) * 1e3, "forwards_ms": forwards_s / len(prompts) * 1e3,
                "rest_ms": (process_s - forwards_s) / len(prompts) * 1e3, "forwards": after[2] - before[2],
                "tokens": tokens / len(prompts)}


def measure(args) -> dict:
    from async_rl.demo import prepare

    with tempfile.TemporaryDirectory() as tmp:
        demo = Path(tmp)
        prepare(demo, seed=0)
        distinct = demo_prompts(str(demo / "model"), max(1, args.requests // 8))  # each sampled 8 times
        prompts = [distinct[i % len(distinct)] for i in range(args.requests)]
        servers = {f"server, window {args.window_ms:g} ms": start_server(demo, args.window_ms),
                   "server, window 0": start_server(demo, 0.0),
                   "empty Ray actor": ray.remote(EmptyServer).options(max_concurrency=1000, num_cpus=0).remote()}
        client = ray.remote(Client).options(num_cpus=0).remote()
        rounds: dict[str, list[dict]] = {f"{name} | {p}": [] for name in servers for p in PATTERNS}
        for index in range(args.rounds + 1):  # the first round warms each case up: left out
            for name, server in servers.items():
                for pattern in PATTERNS:
                    gap_s = args.gap_ms / 1e3 if pattern == "paced" else 0.0
                    result = ray.get(client.send_round.remote(server, prompts, gap_s, f"{index}-{pattern}"),
                                     timeout=TIMEOUT_S)
                    if index:
                        rounds[f"{name} | {pattern}"].append(result)
    cases = {case: {key: statistics.median(r[key] for r in results) for key in results[0]}
             for case, results in rounds.items()}
    return {"requests": args.requests, "gap_ms": args.gap_ms, "window_ms": args.window_ms, "rounds": args.rounds,
            "cases": cases}


def report(result: dict) -> list[str]:
    n, cases = result["requests"], result["cases"]

    def per_round(ms: float) -> str:
        return f"{ms * n / 1e3:+.3f} s a round"

    lines = [f"{n} requests a round, paced: one every {result['gap_ms']:g} ms; the median of {result['rounds']} "
             f"round(s); CPU of the receiving process, ms a request",
             f"{'receiver':<28} {'sent':<6} {'CPU':>7} {'forwards':>9} {'rest':>7} {'forwards/round':>15} "
             f"{'tokens/request':>15}"]
    for case, c in cases.items():
        name, pattern = case.split(" | ")
        lines.append(f"{name:<28} {pattern:<6} {c['cpu_ms']:>7.3f} {c['forwards_ms']:>9.3f} {c['rest_ms']:>7.3f} "
                     f"{c['forwards']:>15.0f} {c['tokens']:>15.2f}")
    ray_call = {p: cases[f"empty Ray actor | {p}"]["rest_ms"] for p in PATTERNS}
    lines.append(f"Ray's call alone (the empty actor): {ray_call['burst']:.3f} ms a request at once, "
                 f"{ray_call['paced']:.3f} paced: pacing {per_round(ray_call['paced'] - ray_call['burst'])}")
    for name in (f"server, window {result['window_ms']:g} ms", "server, window 0"):
        burst, paced = cases[f"{name} | burst"], cases[f"{name} | paced"]
        own = {p: cases[f"{name} | {p}"]["rest_ms"] - ray_call[p] for p in PATTERNS}
        lines.append(f"{name}: beyond Ray's call {own['burst']:.3f} ms a request at once, {own['paced']:.3f} paced; "
                     f"pacing: its rest {per_round(paced['rest_ms'] - burst['rest_ms'])} (beyond Ray's call "
                     f"{per_round(own['paced'] - own['burst'])}), its forwards "
                     f"{per_round(paced['forwards_ms'] - burst['forwards_ms'])}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--gap-ms", type=float, default=2.1)
    parser.add_argument("--window-ms", type=float, default=300.0)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    ray.init(include_dashboard=False, num_cpus=4, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}})
    try:
        result = measure(args)
    finally:
        ray.shutdown()
    result["command"] = command_line()
    print(f"command: {result['command']}")
    print(f"cpus: {os.cpu_count()}")
    for line in report(result):
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
