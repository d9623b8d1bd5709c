"""What a train rank's micro-batch costs on CPU with and without the packed-sequence patches.

verl removes padding: a micro-batch's samples go through the model as one packed sequence. On CPU,
transformers' sdpa attends over the whole packed sequence under an S x S mask it builds first, and
verl's log-probs of labels loop over the packed tokens one at a time. `verl_patches/packed_sdpa.py` and
`verl_patches/row_block_logprobs.py` compute the same values per sample and per block of rows. This
times one micro-batch (forward, verl's `logprobs_from_logits`, backward) of the demo's model on
`--samples` packed samples of `--min-len` to `--max-len` tokens (the lookup demo's shapes: one train
rank's half of 256 trajectories), one thread as in a Ray worker, the two variants alternating in
one process; it also checks that both give the same log-probs.

Usage: python bench/packed_attention.py [--samples 128] [--min-len 8] [--max-len 47] [--repeats 5] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.command import command_line  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--min-len", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=47)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    import torch
    import transformers.masking_utils as masking_utils
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from verl.utils import torch_functional

    from async_rl.demo.task import build_model
    from verl_patches.packed_sdpa import patch_packed_sdpa
    from verl_patches.row_block_logprobs import patch_row_block_logprobs

    torch.set_num_threads(1)
    vocab = 16
    model = build_model(vocab_size=vocab, eos_token_id=1, pad_token_id=0)
    model.config._attn_implementation = "sdpa"
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.min_len, args.max_len + 1, (args.samples,), generator=generator).tolist()
    input_ids = torch.randint(2, vocab, (1, sum(lengths)), generator=generator)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = torch.roll(input_ids, -1, dims=1)

    slots = {"attention": (ALL_ATTENTION_FUNCTIONS, "sdpa"), "mask": (masking_utils, "_preprocess_mask_arguments"),
             "logprobs": (torch_functional, "logprobs_from_logits_v2")}

    def read(owner, name):
        return owner[name] if isinstance(owner, type(ALL_ATTENTION_FUNCTIONS)) else getattr(owner, name)

    def write(owner, name, value):
        if isinstance(owner, type(ALL_ATTENTION_FUNCTIONS)):
            owner[name] = value
        else:
            setattr(owner, name, value)

    originals = {key: read(*slot) for key, slot in slots.items()}
    patch_packed_sdpa()
    patch_row_block_logprobs()
    variants = {"transformers + verl": originals, "patched": {key: read(*slot) for key, slot in slots.items()}}

    def micro_batch():
        model.zero_grad()
        logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
        log_probs = torch_functional.logprobs_from_logits(logits[0], labels[0])
        (-log_probs.mean()).backward()
        return log_probs.detach()

    seconds = {name: [] for name in variants}
    values = {}
    for repeat in range(args.repeats + 1):  # the first round warms up
        for name, functions in variants.items():
            for key, (owner, slot) in slots.items():
                write(owner, slot, functions[key])
            start = time.perf_counter()
            values[name] = micro_batch()
            if repeat:
                seconds[name].append(time.perf_counter() - start)
    def attention_shapes(functions) -> list[list[int]]:
        """The query shape of each torch sdpa call one micro-batch makes with `functions` installed."""
        for key, (owner, slot) in slots.items():
            write(owner, slot, functions[key])
        sdpa, shapes = torch.nn.functional.scaled_dot_product_attention, []

        def recording(query, *rest, **kwargs):
            shapes.append(list(query.shape))
            return sdpa(query, *rest, **kwargs)

        torch.nn.functional.scaled_dot_product_attention = recording
        try:
            micro_batch()
        finally:
            torch.nn.functional.scaled_dot_product_attention = sdpa
        return shapes

    shapes = {name: attention_shapes(functions) for name, functions in variants.items()}  # untimed
    for key, (owner, slot) in slots.items():
        write(owner, slot, originals[key])

    base, patched = (statistics.median(seconds[name]) for name in variants)
    result = {
        "command": command_line(),
        "packed_tokens": sum(lengths),
        "samples": args.samples,
        "transformers_verl_s": base,
        "patched_s": patched,
        "speedup": base / patched,
        "max_abs_log_prob_difference": float((values["patched"] - values["transformers + verl"]).abs().max()),
        "sdpa_query_shapes": shapes,  # [batch, heads, tokens, head dim] of each attention call, per variant
    }
    print(f"command: {result['command']}")
    print(f"one micro-batch: {args.samples} samples, {result['packed_tokens']} packed tokens, 1 thread "
          f"(median of {args.repeats}; forward + log-probs + backward)")
    print(f"  transformers + verl  {base:.3f} s")
    print(f"  patched              {patched:.3f} s")
    print(f"  speedup              {result['speedup']:.1f}x   (log-probs differ by at most "
          f"{result['max_abs_log_prob_difference']:.1e})")
    for name, calls in shapes.items():
        distinct = sorted({tuple(shape) for shape in calls})
        print(f"  {name}: {len(calls)} attention calls over queries of shape {', '.join(map(str, distinct))}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
