"""A task for verl's own `tool_agent` loop with its hermes tool parser (tests/e2e/test_tool_agent_e2e.py).

The demo's 16-character tokenizer cannot write a tool call, so this builds its own: one token per
printable ASCII character, `<tool_call>` / `</tool_call>` as single tokens, a chat template that writes
messages verbatim (tool replies as `<tool_response>...</tool_response>`, the generation prompt "="),
and a tiny Qwen2 taught by 1,200 supervised steps to answer a question by calling the tool
(`<tool_call>{"name": "lookup", "arguments": {"key": "7"}}</tool_call>`), then repeating its reply.
A verl function tool (`lookup`) answers; the reward is 1 when the final answer is the tool's reply.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import pandas as pd
import torch
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

from async_rl.demo.tokenizer import build_tokenizer as build_demo_tokenizer

CALL, END_CALL = "<tool_call>", "</tool_call>"
CHARACTERS = sorted(set(string.printable) - set("\t\r\x0b\x0c"))
TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'tool' -%}<tool_response>{{ message['content'] }}</tool_response>"
    "{%- else -%}{{ message['content'] }}{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{{ eos_token }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}={%- endif -%}"
)
KEY, VALUE = "7", "42"
CALL_TEXT = CALL + json.dumps({"name": "lookup", "arguments": {"key": KEY}}) + END_CALL
QUESTIONS = [f"what is {KEY}?", f"look up {KEY}", f"{KEY}?", f"value of {KEY}"]
TOOLS_FILE = '''
from verl.tools.function_tool import function_tool


@function_tool
async def lookup(key: str) -> str:
    """Looks a key up.

    Args:
        key: the key.
    """
    return {"7": "42"}.get(key, "none")
'''
REWARD_FILE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str.endswith("</tool_response>=" + ground_truth))
'''


def build_tokenizer():
    """The demo's tokenizer builder with printable ASCII and this task's template, plus the tool-call tokens."""
    tokenizer = build_demo_tokenizer(model_max_length=256, characters=CHARACTERS, chat_template=TEMPLATE)
    tokenizer.add_tokens([CALL, END_CALL])  # one token each, kept by decode: what verl's hermes parser looks for
    return tokenizer


def conversation(tokenizer, question: str) -> tuple[list[int], list[int]]:
    """(token ids, 1 where the model writes) of the whole trajectory: question, call, tool reply, answer."""
    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    parts = [(ids(question + "="), 0), (ids(CALL_TEXT) + [tokenizer.eos_token_id], 1),
             (ids(f"<tool_response>{VALUE}</tool_response>="), 0), (ids(VALUE) + [tokenizer.eos_token_id], 1)]
    tokens = [t for part, _ in parts for t in part]
    mask = [m for part, m in parts for _ in part]
    return tokens, mask


def build(root: Path, steps: int = 1200, seed: int = 0) -> dict:
    """Write the model, data, tool and reward under `root`; returns their paths, the final SFT loss and
    `p_taught`: the least, over the questions, probability that the model writes its whole taught part of
    the trajectory (call and answer) when sampled at temperature 1. Measured: 0.988 after 1,200 steps, 0.835
    after 250 (then the e2e test's bar of 3 in 4 trajectories calling the tool fails 7% of runs, binomially)."""
    root.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=1,
                         num_key_value_heads=1, tie_word_embeddings=True, max_position_embeddings=256,
                         vocab_size=len(tokenizer), bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, dtype="float32")
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).float()
    model.generation_config = GenerationConfig(bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    # 3e-3: at 1e-2 the loss oscillated around 0.1-0.3 with transformers 5.10 (measured: 0.005 by step 200 at 3e-3)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    samples = [conversation(tokenizer, q) for q in QUESTIONS]
    loss = torch.tensor(0.0)
    for _ in range(steps):  # the mean over questions of the mean loss of the taught tokens
        loss = sum(-_taught_log_prob(model, tokens, mask) / sum(mask[1:]) for tokens, mask in samples) / len(samples)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        p_taught = min(float(_taught_log_prob(model, tokens, mask).exp()) for tokens, mask in samples)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    rows = [{"data_source": "tool_task", "prompt": [{"role": "user", "content": q}], "ability": "tool",
             "reward_model": {"style": "rule", "ground_truth": VALUE}, "extra_info": {"index": i}}
            for i, q in enumerate(QUESTIONS * 4)]
    pd.DataFrame(rows).to_parquet(root / "train.parquet")
    pd.DataFrame(rows[:4]).to_parquet(root / "val.parquet")
    (root / "tools.py").write_text(TOOLS_FILE)
    (root / "reward.py").write_text(REWARD_FILE)
    return {"root": root, "loss": float(loss.detach()), "p_taught": p_taught}


def _taught_log_prob(model, tokens: list[int], mask: list[int]) -> torch.Tensor:
    """Log-probability of the model's tokens of one trajectory (mask 1) given the rest before them."""
    log_probs = model(input_ids=torch.tensor([tokens])).logits[0, :-1].log_softmax(-1)
    picked = log_probs.gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
    return picked[torch.tensor(mask[1:], dtype=torch.bool)].sum()


def overrides(root: Path) -> dict:
    """The demo's keys with this task's model, data, reward and verl's tool agent loop (hermes parser)."""
    rollout = "actor_rollout_ref.rollout"
    return {"actor_rollout_ref.model.path": str(root / "model"), "data.train_files": str(root / "train.parquet"),
            "data.val_files": str(root / "val.parquet"), "reward.custom_reward_function.path": str(root / "reward.py"),
            "data.max_prompt_length": 32, "data.max_response_length": 128, "data.train_batch_size": 4,
            "actor_rollout_ref.actor.ppo_mini_batch_size": 4, "actor_rollout_ref.rollout.n": 4,
            f"{rollout}.agent.default_agent_loop": "tool_agent", f"{rollout}.multi_turn.enable": True,
            f"{rollout}.multi_turn.format": "hermes", f"{rollout}.multi_turn.function_tool_path": str(root / "tools.py"),
            f"{rollout}.multi_turn.max_assistant_turns": 2}
