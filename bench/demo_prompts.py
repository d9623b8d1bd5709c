"""The demo task's prompts as verl's agent loop sends them: chat-templated token ids, for the benches that
drive a rollout server directly."""

from __future__ import annotations


def demo_prompts(model_path: str, count: int) -> list[list[int]]:
    """`count` chat-templated prompts of the demo's task (random digit strings)."""
    import numpy as np
    from transformers import AutoTokenizer

    from async_rl.demo.task import make_rows, sample_prompts

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    train, _ = sample_prompts(np.random.default_rng(0), count, 0)
    prompts = []
    for messages in make_rows(list(train)[:count], "train")["prompt"]:
        ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return prompts
