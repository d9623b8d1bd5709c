"""A vision-language model's rows through the pipeline's data path (async_rl/core/messages.py, the agent
loops' output in async_rl/rollout/agent_loops.py, async_rl/training/engine_calls.py): verl's
`multi_modal_inputs` and its (bs, 4, seq_len) multimodal-RoPE position ids survive the trip from verl's
agent-loop output to the training batch, and verl's FSDP engine computes a tiny Qwen2-VL's log-probs of
such a batch as the model's own forward with the image does, then trains it (end to end:
tests/e2e/test_images_e2e.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from async_rl.core.messages import MULTI_MODAL_INPUTS, ROPE_ROWS, Sample, build_batch


def rope_sample(uid: str, prompt: int, response: int, offset: int) -> Sample:
    """A sample whose RoPE rows are distinct numbers per row and token (row r, token t: offset + 100 r + t)."""
    length = prompt + response
    rows = [[offset + 100 * r + t for t in range(length)] for r in range(ROPE_ROWS)]
    return Sample(uid=uid, prompt_ids=list(range(1, prompt + 1)), response_ids=list(range(1, response + 1)),
                  rollout_log_probs=[0.0] * response, token_versions=[0] * response, rope_position_ids=rows,
                  non_tensor={MULTI_MODAL_INPUTS: {"pixel_values": torch.full((2, 3), float(offset))}})


def test_build_batch_lays_the_rope_rows_out_as_the_tokens_truncated_alike():
    samples = [rope_sample("a", 3, 2, 0), rope_sample("b", 6, 5, 1000)]  # b: prompt and response cut to 4 and 3
    batch = build_batch(samples, max_prompt_length=4, max_response_length=3, pad_token_id=0)
    positions = batch.batch["position_ids"]
    assert positions.shape == (2, 1 + ROPE_ROWS, 7)
    mask = batch.batch["attention_mask"]
    text = build_batch([Sample(**{**s.__dict__, "rope_position_ids": None}) for s in samples], 4, 3, 0)
    assert torch.equal(positions[:, 0], text.batch["position_ids"])  # row 0: the text positions, as before
    # a: prompt tokens 0-2 in columns 1-3, response tokens 3-4 in columns 4-5; padding 1
    for r in range(ROPE_ROWS):
        assert positions[0, 1 + r].tolist() == [1] + [100 * r + t for t in range(5)] + [1]
        # b: the prompt's last 4 (tokens 2-5), the response's first 3 (tokens 6-8)
        assert positions[1, 1 + r].tolist() == [1000 + 100 * r + t for t in (2, 3, 4, 5, 6, 7, 8)]
    assert mask[0].tolist() == [0, 1, 1, 1, 1, 1, 0] and mask[1].tolist() == [1] * 7
    # the processor's outputs ride in the non-tensor column, row by row
    assert [float(m["pixel_values"][0, 0]) for m in batch.non_tensor_batch[MULTI_MODAL_INPUTS]] == [0.0, 1000.0]


def test_a_batch_mixing_rope_and_text_samples_is_refused():
    text = Sample(uid="t", prompt_ids=[1, 2], response_ids=[3], rollout_log_probs=[0.0], token_versions=[0])
    with pytest.raises(ValueError, match="mixes samples"):
        build_batch([rope_sample("a", 2, 1, 0), text], 4, 3, 0)
    wrong = rope_sample("w", 2, 1, 0)
    wrong.rope_position_ids = [row[:-1] for row in wrong.rope_position_ids]
    with pytest.raises(ValueError, match="sample w: RoPE rows of shape"):
        build_batch([wrong], 4, 3, 0)


def test_verls_agent_loop_output_keeps_its_positions_and_inputs_through_the_samples():
    """verl's agent-loop output (padded, position ids (bs, 4, seq_len)) -> Samples -> build_batch at the same
    widths gives verl's own position ids back on every real token, and each row's `multi_modal_inputs`."""
    from verl import DataProto

    from async_rl.rollout.agent_loops import VERSIONS_FIELD, samples_from_agent_output

    prompt_width, response_width = 5, 4
    prompts = torch.tensor([[0, 0, 7, 8, 9], [0, 7, 8, 8, 9]])
    responses = torch.tensor([[3, 4, 0, 0], [3, 4, 5, 6]])
    attention = torch.cat([(prompts != 0).long(), (responses != 0).long()], dim=1)
    generator = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 50, (2, 4, prompt_width + response_width), generator=generator)
    pixels = [torch.randn(4, 6, generator=generator) for _ in range(2)]
    output = DataProto.from_dict(
        tensors={"prompts": prompts, "responses": responses, "attention_mask": attention,
                 "input_ids": torch.cat([prompts, responses], 1), "position_ids": positions,
                 "response_mask": (responses != 0).long()},
        non_tensors={"uid": np.array(["u0", "u1"], dtype=object),
                     VERSIONS_FIELD: np.array([[2, 2], [2, 3, 3, 3]], dtype=object),
                     MULTI_MODAL_INPUTS: np.array([{"pixel_values": p} for p in pixels], dtype=object)})
    samples = samples_from_agent_output(output, start_version=2)
    batch = build_batch(samples, prompt_width, response_width, pad_token_id=0)
    assert torch.equal(batch.batch["attention_mask"], attention)
    real = attention.bool()
    got = batch.batch["position_ids"]
    for i in range(2):
        assert torch.equal(got[i, 1:, real[i]], positions[i, 1:, real[i]])  # verl's RoPE rows
    for i, row in enumerate(batch.non_tensor_batch[MULTI_MODAL_INPUTS]):
        assert torch.equal(row["pixel_values"], pixels[i])


ENGINE_SCRIPT = """
import json, os, sys
import numpy as np, ray, torch, verl
from hydra import compose, initialize_config_dir
from PIL import Image
from async_rl.core.messages import MULTI_MODAL_INPUTS, Sample, build_batch
from async_rl.demo import demo_overrides
from async_rl.demo.vision import IMAGE_PAD, VISION_END, VISION_START, build_image_processor, save_vl_model
from async_rl.run_config import ray_init_kwargs
from async_rl.training import engine_calls
from async_rl.training.worker_groups import make_worker_group
from transformers import AutoModelForImageTextToText, AutoTokenizer

demo_dir, out_path = sys.argv[1], sys.argv[2]
model_dir = str(save_vl_model(os.path.join(os.path.dirname(out_path), "vl_model")))
tokenizer, images = AutoTokenizer.from_pretrained(model_dir), build_image_processor()
model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
rng = np.random.default_rng(0)
P, R = 16, 4
samples, forwards = [], []
for i in range(4):
    image = Image.fromarray((rng.random((40 + 8 * i, 56, 3)) * 255).astype("uint8"))
    inputs = dict(images(images=[image], return_tensors="pt"))
    count = int(inputs["image_grid_thw"].prod()) // 4
    prompt = tokenizer(VISION_START + IMAGE_PAD * count + VISION_END + "12" * (i + 1) + "=")["input_ids"]
    response = [int(t) for t in rng.integers(3, 13, R)]
    ids = torch.tensor([prompt + response])
    token_types = (ids == model.config.image_token_id).long()  # 1: an image token
    rope, _ = model.model.get_rope_index(input_ids=ids, mm_token_type_ids=token_types, image_grid_thw=inputs["image_grid_thw"])
    samples.append(Sample(uid=f"u{i}", prompt_ids=prompt, response_ids=response, rollout_log_probs=[0.0] * R,
                          token_versions=[0] * R, rope_position_ids=rope[:, 0].tolist(),
                          non_tensor={MULTI_MODAL_INPUTS: inputs}))
    with torch.no_grad():  # the model's own forward with its image, one row, no padding
        logits = model(input_ids=ids, mm_token_type_ids=token_types, **inputs).logits[0, len(prompt) - 1 : -1]
    forwards.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0])
batch = build_batch(samples, P, R, tokenizer.pad_token_id)
with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"), version_base=None):
    config = compose("ppo_trainer", overrides=demo_overrides(demo_dir, extra={
        "actor_rollout_ref.model.path": model_dir, "actor_rollout_ref.model.use_remove_padding": False,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 4, "actor_rollout_ref.rollout.n": 1,
        "data.max_prompt_length": P, "data.max_response_length": R, "actor_rollout_ref.actor.optim.lr": 1e-3}))
ray.init(**ray_init_kwargs(config))
group = make_worker_group(config, "actor", 1, "vl_actor")
before = engine_calls.compute_log_prob(group, batch, 1.0)
batch.batch["old_log_probs"] = before
batch.batch["rollout_log_probs"] = before
batch.batch["advantages"] = torch.tensor([[1.0], [-1.0], [1.0], [-1.0]]).expand(4, R).contiguous()
metrics = engine_calls.update_actor(group, batch, config.actor_rollout_ref)
after = engine_calls.compute_log_prob(group, batch, 1.0)
ray.shutdown()
json.dump({"engine": before.tolist(), "forward": torch.stack(forwards).tolist(), "after": after.tolist(),
           "grad_norm": metrics["actor/grad_norm"]}, open(out_path, "w"))
"""


@pytest.mark.slow
def test_verls_engine_computes_a_vl_models_log_probs_with_its_images_and_trains_it(demo_dir, tmp_path, ray_address):
    """A batch of four image prompts (images of different sizes, one image each) built from Samples: verl's
    FSDP engine (use_remove_padding=False: verl's packed path for multimodal RoPE needs flash-attention) gives
    each response token the log-prob of the model's own forward with the image, which it would not without
    `multi_modal_inputs` (the image tokens would be plain embeddings) or with text positions; one update
    with advantages +1/-1 moves the log-probs of the +1 rows up against those of the -1 rows."""
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT, str(demo_dir), str(out)], cwd=tmp_path,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", "RAY_ADDRESS": ray_address},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    result = json.loads(out.read_text())
    engine, forward, after = (torch.tensor(result[k]) for k in ("engine", "forward", "after"))
    assert torch.allclose(engine, forward, atol=1e-5), (engine - forward).abs().max()
    assert result["grad_norm"] > 0
    moved = (after - engine).sum(-1)  # per row
    assert moved[0] + moved[2] > moved[1] + moved[3], moved
