"""What running verl's agent loop costs the generate stage per sample, beside the bare request.

The generate stage runs every sample as a trajectory of verl's agent loop (async_rl/rollout/agent_loops.py:
verl's AgentLoopWorker instantiates the loop, builds the prompt's tokens, post-processes and pads the
output). This measures that work alone: rollout servers that answer at once (a fixed 8-token reply), the
demo's config and tokenizer, batches of `--prompts` x `--n` samples, timed in one process:

- `agent loop`: the stage's `process_data` (every sample through verl's single-turn agent loop);
- `bare request`: the same requests sent as the stage sent them before agent loops (pre-tokenized
  prompt, `generate_resumable`, one Sample each).

Usage: python bench/agent_loop_overhead.py [--prompts 32] [--n 8] [--batches 5] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.command import command_line  # noqa: E402

REPLY = [5, 6, 7, 8, 9, 10, 11, 12]


def instant_server(received: list):
    """A rollout server handle that answers every request at once with REPLY; appends each request's
    prompt length (tokens) to `received`."""
    from verl.workers.rollout.replica import TokenOutput

    class Server:
        class generate:  # noqa: N801 - mimics a Ray actor method
            @staticmethod
            async def remote(**kwargs):
                received.append(len(kwargs["prompt_ids"]))
                return TokenOutput(token_ids=REPLY, log_probs=[-0.5] * len(REPLY), stop_reason="completed",
                                   extra_fields={"token_versions": [0] * len(REPLY)})

    return Server


async def time_batches(run_batch, batches: int) -> list[float]:
    """Seconds per batch, after one warm-up batch."""
    await run_batch(0)
    times = []
    for index in range(1, batches + 1):
        start = time.perf_counter()
        await run_batch(index)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--batches", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    from hydra import compose, initialize_config_dir
    import verl

    from async_rl.core.config import strip_async_keys
    from async_rl.core.messages import PromptBatch, Sample
    from async_rl.core.prompts import batch_rows, load_prompt_dataset, make_train_dataloader, tokenize_row
    from async_rl.demo import demo_overrides, prepare
    from async_rl.rollout.requests import generate_resumable
    from async_rl.core.policy_clock import ClockRef
    from async_rl.core.staleness import StalenessGate
    from state_machines.generate import GenerateStage

    root = Path(tempfile.mkdtemp(prefix="agent_loop_overhead_"))
    prepare(root, seed=0, train_size=max(64, args.prompts), val_size=8)
    extra = {"actor_rollout_ref.rollout.n": args.n, "data.train_batch_size": args.prompts}
    with initialize_config_dir(config_dir=str(Path(verl.__file__).parent / "trainer" / "config"), version_base=None):
        config = compose("ppo_trainer", overrides=demo_overrides(root, extra=extra))
    strip_async_keys(config)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.actor_rollout_ref.model.path)
    loader = make_train_dataloader(config.data, load_prompt_dataset(config.data.train_files, config.data, tokenizer, True))
    rows = [tokenize_row(row, tokenizer, int(config.data.max_prompt_length)) for row in batch_rows(next(iter(loader)))]
    received: list[int] = []  # every request's prompt length, as the servers got it
    stage = GenerateStage(servers=[instant_server(received), instant_server(received)], config=config,
                          clock=ClockRef.in_process(StalenessGate(1)))
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": int(config.actor_rollout_ref.rollout.response_length),
              "logprobs": True}

    async def agent_loop_batch(index: int):
        await stage.process_data(PromptBatch(index, [info for _, info in rows]))

    async def bare_batch(index: int):
        jobs = [generate_resumable(stage.servers, k % 2, ids, params, 60.0, 0) for k, (ids, _) in
                enumerate(r for r in rows for _ in range(args.n))]
        outs = await asyncio.gather(*jobs)
        [Sample(uid=str(k), prompt_ids=[], response_ids=o.token_ids, rollout_log_probs=o.log_probs,
                token_versions=o.token_versions) for k, o in enumerate(outs)]

    sent = {}  # variant -> (requests, prompt tokens) the servers received over its batches

    async def measure():
        agent = await time_batches(agent_loop_batch, args.batches)
        sent["agent_loop"] = (len(received), sum(received))
        received.clear()
        bare = await time_batches(bare_batch, args.batches)
        sent["bare_request"] = (len(received), sum(received))
        return agent, bare

    agent, bare = asyncio.run(measure())
    samples = args.prompts * args.n
    result = {
        "command": command_line(),
        "samples_per_batch": samples,
        "agent_loop_s_per_batch": statistics.median(agent),
        "bare_request_s_per_batch": statistics.median(bare),
        # what the servers received over the warm-up and timed batches of each variant
        "requests_received": {name: requests for name, (requests, _) in sent.items()},
        "prompt_tokens_received": {name: tokens for name, (_, tokens) in sent.items()},
    }
    result["agent_loop_ms_per_sample"] = 1000 * result["agent_loop_s_per_batch"] / samples
    result["bare_request_ms_per_sample"] = 1000 * result["bare_request_s_per_batch"] / samples
    result["ratio"] = result["agent_loop_s_per_batch"] / result["bare_request_s_per_batch"]
    print(f"command: {result['command']}")
    print(f"{samples} samples a batch (median of {args.batches} batches, instant servers)")
    print(f"  agent loop    {result['agent_loop_s_per_batch']:.3f} s / batch  {result['agent_loop_ms_per_sample']:.2f} ms / sample")
    print(f"  bare request  {result['bare_request_s_per_batch']:.3f} s / batch  {result['bare_request_ms_per_sample']:.2f} ms / sample")
    print(f"  ratio         {result['ratio']:.1f}x")
    for name, requests in result["requests_received"].items():
        print(f"  {name}: the servers received {requests} requests, "
              f"{result['prompt_tokens_received'][name]} prompt tokens ({args.batches + 1} batches with the warm-up)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
