"""verl's RL data as the pipeline reads it: the dataset and dataloader verl's trainer builds, and
each row's prompt tokenized with the model's chat template, as verl's rollout does. Used by the
dataloader stage, validation and the checks before Ray starts."""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import sys

import torch

from async_rl.core.data_checks import prompt_too_long_error
from async_rl.core.model_class import has_vision_tower


def model_tokenizer_and_processor(config):
    """(tokenizer, processor) as verl's trainer loads them: its HFModelConfig's (actor_rollout_ref.model:
    tokenizer_path, trust_remote_code, custom_chat_template), built once; the processor only for a model
    with a vision tower, else None."""
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import HFModelConfig

    model = omega_conf_to_dataclass(config.actor_rollout_ref.model, dataclass_type=HFModelConfig)
    return model.tokenizer, (model.processor if has_vision_tower(model.hf_config) else None)


def model_tokenizer(config):
    """The tokenizer of `model_tokenizer_and_processor`."""
    return model_tokenizer_and_processor(config)[0]


def load_prompt_dataset(data_files, data_config, tokenizer, is_train: bool, processor=None):
    """verl's RL dataset for `data_files` (parquet paths), capped at verl's `{train,val}_max_samples`;
    `processor`: a vision-language model's (`model_tokenizer_and_processor`), which verl's dataset needs for
    image rows."""
    from verl.trainer.ppo.utils import create_rl_dataset

    max_samples = data_config.get("train_max_samples" if is_train else "val_max_samples", -1)
    return create_rl_dataset(data_files, data_config, tokenizer, processor, is_train=is_train,
                             max_samples=-1 if max_samples is None else max_samples)


def make_train_dataloader(data_config, dataset):
    """The training dataloader exactly as verl's trainer builds it (same batches, same state); its
    worker processes (`data.dataloader_num_workers`) die with the process that iterates it."""
    from torchdata.stateful_dataloader import StatefulDataLoader
    from verl.trainer.ppo.utils import create_rl_sampler
    from verl.utils.dataset.rl_dataset import collate_fn

    return StatefulDataLoader(
        dataset=dataset,
        batch_size=int(data_config.train_batch_size),
        num_workers=int(data_config.get("dataloader_num_workers", 0) or 0),
        drop_last=True,
        collate_fn=collate_fn,
        sampler=create_rl_sampler(data_config, dataset),
        worker_init_fn=functools.partial(die_with_parent, parent=os.getpid()),
    )


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(worker_id: int = 0, parent: int = 0) -> None:
    """Have the kernel SIGKILL this process when the thread that started it exits (Linux; elsewhere
    nothing); exit at once if `parent` (its pid; 0: the current parent) is already gone. A DataLoader
    worker whose stage was killed would otherwise live on, orphaned, blocked on its full result pipe."""
    if not sys.platform.startswith("linux"):
        return
    parent = parent or os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the prctl
        os._exit(1)


def tokenize_row(row: dict, tokenizer, max_prompt_length: int, truncation: str = "left", files=None,
                 prompt_key: str = "prompt") -> tuple[list[int], dict]:
    """Chat-template token ids of one dataset row and its non-tensor fields (every field verl's agent
    loops get: `raw_prompt`, `data_source`, `reward_model`, `extra_info`, `index`, `tools_kwargs`,
    `interaction_kwargs`, `agent_name` where the data has it, ...).

    A prompt over ``max_prompt_length`` tokens is left-truncated, as verl 0.9.1's agent loop
    does, unless ``truncation`` is "error" (verl's `data.truncation` default): then a BadDataError
    names the row of ``files`` it came from.
    """
    ids = tokenizer.apply_chat_template(list(row["raw_prompt"]), add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    ids = list(ids)
    if len(ids) > max_prompt_length and truncation == "error":
        raise prompt_too_long_error(files, prompt_key, row["raw_prompt"], len(ids), max_prompt_length)
    return ids[-max_prompt_length:], {k: v for k, v in row.items() if not isinstance(v, torch.Tensor)}


def batch_rows(batch: dict) -> list[dict]:
    """verl's collated batch (arrays by key) as one dict per row."""
    size = len(batch["raw_prompt"])
    return [{key: values[i] for key, values in batch.items()} for i in range(size)]
