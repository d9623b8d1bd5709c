"""dataloader stage: reads verl's RL dataset and emits one prompt batch per training step.

Uses verl's `create_rl_dataset` / `create_rl_sampler` (the same files, filters and
shuffling as verl's trainers) and tokenizes each chat prompt with the model's chat
template, as verl's rollout does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from state_machines.base import END_OF_STREAM, StateMachine

_NON_TENSOR_KEYS = ("data_source", "reward_model", "extra_info", "index")


@dataclass
class PromptBatch:
    """Prompts of one training step (`index` = the step's batch index, 0-based)."""

    index: int
    prompt_ids: list[list[int]]
    non_tensor: list[dict[str, Any]] = field(default_factory=list)


def load_prompt_dataset(data_files, data_config, tokenizer, is_train: bool):
    """verl's RL dataset for `data_files` (parquet paths)."""
    from verl.trainer.ppo.utils import create_rl_dataset

    return create_rl_dataset(data_files, data_config, tokenizer, None, is_train=is_train)


def tokenize_row(row: dict, tokenizer, max_prompt_length: int) -> tuple[list[int], dict]:
    """Chat-template token ids of one dataset row (left-truncated) and its non-tensor fields."""
    ids = tokenizer.apply_chat_template(row["raw_prompt"], add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    ids = list(ids)[-max_prompt_length:]
    return ids, {k: row[k] for k in _NON_TENSOR_KEYS if k in row}


class DataloaderStage(StateMachine):
    """Emits `total_steps` PromptBatches of `batch_size` prompts, cycling over epochs
    (`total_steps=None`: until `stop_producing()`; dynamic sampling draws as many as it needs)."""

    def __init__(self, config, tokenizer, total_steps: int | None, inbox_size: int = 1):
        super().__init__("dataloader", inbox_size=inbox_size)
        from verl.trainer.ppo.utils import create_rl_sampler

        self.dataset = load_prompt_dataset(config.data.train_files, config.data, tokenizer, is_train=True)
        self.sampler = create_rl_sampler(config.data, self.dataset)
        self.tokenizer = tokenizer
        self.batch_size = int(config.data.train_batch_size)
        self.max_prompt_length = int(config.data.max_prompt_length)
        self.total_steps = total_steps
        if len(self.dataset) < self.batch_size:
            raise ValueError(
                f"data.train_batch_size={self.batch_size} is larger than the training set "
                f"({len(self.dataset)} rows in {config.data.train_files})"
            )
        self._step = 0
        self._order = iter(())

    def _next_index(self) -> int:
        try:
            return next(self._order)
        except StopIteration:
            self._order = iter(list(self.sampler))
            return next(self._order)

    async def get_input_data(self):
        if self.total_steps is not None and self._step >= self.total_steps:
            return END_OF_STREAM
        step = self._step
        self._step += 1
        return step

    def stop_producing(self) -> None:
        """Emit no more batches after those already read (the end of the stream follows)."""
        self.total_steps = self._step

    async def process_data(self, step: int) -> PromptBatch:
        rows = [self.dataset[self._next_index()] for _ in range(self.batch_size)]
        tokenized = [tokenize_row(r, self.tokenizer, self.max_prompt_length) for r in rows]
        return PromptBatch(index=step, prompt_ids=[t[0] for t in tokenized], non_tensor=[t[1] for t in tokenized])

    async def send_output_data(self, data: PromptBatch) -> bool:
        return await self.send_downstream(data)
