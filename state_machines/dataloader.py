"""dataloader stage: reads verl's RL dataset and emits one prompt batch per training step.

The batches come from the dataloader verl's trainer builds (`create_rl_dataset`,
`create_rl_sampler`, torchdata's `StatefulDataLoader` with verl's `collate_fn`, drawn as verl's
trainer draws them, a new epoch on exhaustion), so a run with the same seed trains the same
prompts at the same steps as verl's trainer, and its state is verl's `data.pt`. The stage
keeps the loader's state before each batch it emits until a checkpoint takes it
(`state_before`). A batch carries each prompt's dataset row (`raw_prompt`, `reward_model`, ...);
the agent loop of the generate stage builds the prompt's tokens, as in verl's trainer.
"""

from __future__ import annotations

import copy
from typing import Optional

from async_rl.core.messages import PromptBatch
from async_rl.core.prompts import batch_rows, load_prompt_dataset, make_train_dataloader, tokenize_row
from state_machines.base import END_OF_STREAM, StateMachine


class DataloaderStage(StateMachine):
    """Emits PromptBatches `first_index`, `first_index + 1`, ... up to `total_batches` (exclusive),
    cycling over epochs (`total_batches=None`: until `stop_producing()`; dynamic sampling draws
    as many as it needs).

    Args:
        resume_state: the loader's state before batch `first_index` (verl's `data.pt`), or None.
        processor: a vision-language model's, for image rows (`model_tokenizer_and_processor`), or None.
    """

    def __init__(self, *, config, tokenizer, total_batches: Optional[int], first_index: int = 0,
                 resume_state: Optional[dict] = None, inbox_size: int = 1, processor=None):
        super().__init__("dataloader", inbox_size=inbox_size)
        self.dataset = load_prompt_dataset(config.data.train_files, config.data, tokenizer, is_train=True,
                                           processor=processor)
        self.batch_size = int(config.data.train_batch_size)
        if len(self.dataset) < self.batch_size:
            raise ValueError(
                f"data.train_batch_size={self.batch_size} is larger than the training set "
                f"({len(self.dataset)} rows in {config.data.train_files})"
            )
        self.loader = make_train_dataloader(config.data, self.dataset)
        if resume_state is not None:
            self.loader.load_state_dict(resume_state)
        self.tokenizer = tokenizer
        self.max_prompt_length = int(config.data.max_prompt_length)
        self.truncation = str(config.data.get("truncation", "error"))
        self.files, self.prompt_key = config.data.train_files, str(config.data.get("prompt_key", "prompt"))
        self.total_batches = total_batches
        self._step = first_index
        self._batches = None  # the loader's iterator (verl's trainer starts a new one on exhaustion)
        self._states = {first_index: copy.deepcopy(self.loader.state_dict())}  # batch index -> loader state before it

    async def get_input_data(self):
        if self.total_batches is not None and self._step >= self.total_batches:
            return END_OF_STREAM
        step = self._step
        self._step += 1
        return step

    def stop_producing(self) -> None:
        """Emit no more batches after those already read (the end of the stream follows)."""
        self.total_batches = self._step

    def state_before(self, index: int) -> dict:
        """The loader's state before batch `index` (what a checkpoint whose oldest untrained batch is
        `index` saves as verl's data.pt); earlier states are dropped."""
        if index not in self._states:
            raise KeyError(f"no dataloader state kept for batch {index} (kept: {sorted(self._states)})")
        for old in [i for i in self._states if i < index]:
            del self._states[old]
        return self._states[index]

    def _next_batch(self) -> dict:
        try:
            if self._batches is None:
                self._batches = iter(self.loader)
            return next(self._batches)
        except StopIteration:
            self._batches = iter(self.loader)
            return next(self._batches)

    async def process_data(self, step: int) -> PromptBatch:
        rows = batch_rows(self._next_batch())
        self._states[step + 1] = copy.deepcopy(self.loader.state_dict())
        # the chat template's tokens only to refuse an over-long prompt here, naming its row (data.truncation=error);
        # the agent loop builds the prompt's tokens itself
        tokenized = [tokenize_row(r, self.tokenizer, self.max_prompt_length, self.truncation, self.files,
                                  self.prompt_key) for r in rows]
        return PromptBatch(index=step, non_tensor=[info for _, info in tokenized])
