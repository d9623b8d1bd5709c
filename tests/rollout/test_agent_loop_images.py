"""Image rows through verl's agent loops in the generate stage (async_rl/rollout/agent_loops.py), without Ray:
verl's dataset gives a row its image, verl's single-turn loop sends it with the prompt's expanded image
tokens to a scripted server (`image_data`), and the samples carry verl's `multi_modal_inputs` and the
model's multimodal-RoPE rows to the trainer."""

from __future__ import annotations

import asyncio

import numpy as np
import torch

from async_rl.core.messages import MULTI_MODAL_INPUTS, PromptBatch, build_batch
from async_rl.demo.task import sample_prompts
from async_rl.demo.vision import IMAGE_PAD, image_rows, save_vl_model
from helpers.lineage import compose_ppo
from helpers.scripted_server import ScriptedServer
from async_rl.core.policy_clock import ClockRef
from async_rl.core.staleness import StalenessGate
from state_machines.generate import GenerateStage

ANSWER = [5, 6, 7]  # the server's tokens for every request


def test_an_image_row_reaches_the_server_and_the_trainer(demo_dir, tmp_path):
    from transformers import AutoModelForImageTextToText

    from async_rl.core.config import strip_async_keys
    from async_rl.core.prompts import load_prompt_dataset, model_tokenizer_and_processor, tokenize_row
    from async_rl.demo import demo_overrides
    from verl_patches.vision_without_torchvision import (patch_processors_without_torchvision,
                                                         patch_qwen_vl_utils_without_torchvision)

    patch_processors_without_torchvision()  # as in every process of a CPU run
    patch_qwen_vl_utils_without_torchvision()
    model_dir = save_vl_model(tmp_path / "model", seed=3)
    train, _ = sample_prompts(np.random.default_rng(0), 2, 0)
    image_rows(train, "train").to_parquet(tmp_path / "train.parquet")
    config = compose_ppo(demo_overrides(demo_dir, extra={
        "actor_rollout_ref.model.path": str(model_dir), "data.train_files": str(tmp_path / "train.parquet"),
        "data.max_prompt_length": 16, "actor_rollout_ref.rollout.n": 2}))
    strip_async_keys(config)
    tokenizer, processor = model_tokenizer_and_processor(config)
    dataset = load_prompt_dataset(config.data.train_files, config.data, tokenizer, True, processor=processor)
    rows = [tokenize_row(dataset[i], tokenizer, 16)[1] for i in range(2)]

    server = ScriptedServer(lambda kwargs, calls: (ANSWER, 0, "completed"))
    stage = GenerateStage(servers=[server], config=config, clock=ClockRef.in_process(StalenessGate(1)))
    out = asyncio.run(asyncio.wait_for(stage.process_data(PromptBatch(0, rows)), 60))

    image_token = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    assert len(server.calls) == 4
    for call in server.calls:  # each request: the prompt with the image's 4 tokens, and the image
        assert sum(t == image_token for t in call["prompt_ids"]) == 4
        assert [image.size for image in call["image_data"]] == [(56, 56)]
    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    assert len(out.samples) == 4
    for sample in out.samples:
        assert sample.response_ids == ANSWER
        inputs = sample.non_tensor[MULTI_MODAL_INPUTS]
        assert inputs["image_grid_thw"].tolist() == [[1, 4, 4]] and inputs["pixel_values"].shape[0] == 16
        ids = torch.tensor([sample.prompt_ids + sample.response_ids])
        rope, _ = model.model.get_rope_index(input_ids=ids, mm_token_type_ids=(ids == image_token).long(),
                                             image_grid_thw=inputs["image_grid_thw"])
        assert sample.rope_position_ids == rope[:, 0].tolist()  # the model's own multimodal RoPE
    batch = build_batch(out.samples, 16, 4, pad_token_id=0)
    assert batch.batch["position_ids"].shape == (4, 4, 20)
