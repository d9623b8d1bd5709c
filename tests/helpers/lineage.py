"""Test oracle: what each step of a demo run trains. The prompts verl's dataloader gives each step against
verl's rollout dumps (`trainer.rollout_data_dir`, one `{step}.jsonl` per step, rewritten when a
restarted run trains the step again). Tests and `bench/faults.py` compare the two to count
samples lost or trained twice."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path


def compose_ppo(overrides):
    """Compose verl's ppo_trainer config (as `main_ppo` does); unknown keys raise."""
    import verl
    from hydra import compose, initialize_config_dir

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose("ppo_trainer", overrides=list(overrides))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def expected_step_inputs(demo_dir: Path, steps: int, extra=None) -> dict[int, Counter]:
    """Step -> multiset of prompts (decoded as verl's rollout dumps decode them, one per sample) that
    verl's dataloader gives steps 1..`steps` of the demo: what an uninterrupted run trains."""
    from transformers import AutoTokenizer

    from async_rl.core.prompts import batch_rows, load_prompt_dataset, make_train_dataloader, tokenize_row
    from async_rl.demo import demo_overrides

    config = compose_ppo(demo_overrides(demo_dir, extra=extra))
    tokenizer = AutoTokenizer.from_pretrained(config.actor_rollout_ref.model.path)
    loader = make_train_dataloader(config.data, load_prompt_dataset(config.data.train_files, config.data, tokenizer, True))
    n, out, batches = int(config.actor_rollout_ref.rollout.n), {}, iter(loader)
    for step in range(1, steps + 1):
        try:
            batch = next(batches)
        except StopIteration:
            batches = iter(loader)
            batch = next(batches)
        ids = [tokenize_row(row, tokenizer, int(config.data.max_prompt_length))[0] for row in batch_rows(batch)]
        out[step] = Counter(tokenizer.decode(i, skip_special_tokens=True) for i in ids for _ in range(n))
    return out


def dumped_step_inputs(dump_dir: Path) -> dict[int, Counter]:
    """Step -> multiset of the `input` field of verl's `{step}.jsonl` rollout dumps."""
    return {int(p.stem): Counter(r["input"] for r in read_jsonl(p)) for p in dump_dir.glob("*.jsonl")}
