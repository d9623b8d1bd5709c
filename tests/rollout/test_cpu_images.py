"""Images in the CPU engine (async_rl/rollout/cpu/vision.py) on the tiny Qwen2-VL of async_rl/demo/vision.py:
in one running batch with a text prompt, each image prompt gets the greedy tokens and log-probs of the
model's own forward with its image (multimodal RoPE), also across a weight load that re-prefills it; a
prompt whose image tokens do not match its images fails alone, naming the counts."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from PIL import Image

from async_rl.demo.vision import IMAGE_PAD, VISION_END, VISION_START, build_image_processor, save_vl_model
from async_rl.rollout.cpu.engine import ContinuousBatchingEngine

TIMEOUT_S = 120


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return str(save_vl_model(tmp_path_factory.mktemp("tiny_qwen2_vl"), seed=3))


def image_prompt(tokenizer, shape: tuple[int, int], seed: int, text: str):
    """(prompt ids with the image's tokens expanded, the processor's outputs) for one random image."""
    image = Image.fromarray((np.random.default_rng(seed).random((*shape, 3)) * 255).astype("uint8"))
    inputs = dict(build_image_processor()(images=[image], return_tensors="pt"))
    count = int(inputs["image_grid_thw"].prod()) // 4
    return tokenizer(VISION_START + IMAGE_PAD * count + VISION_END + text + "=")["input_ids"], inputs


def own_forward_logprobs(model, prompt, inputs, tokens):
    """log_softmax of the model's own unbatched forward with the image, at each generated token."""
    ids = torch.tensor([prompt + tokens])
    kwargs = {**inputs, "mm_token_type_ids": (ids == model.config.image_token_id).long()} if inputs else {}
    with torch.no_grad():
        logits = model(input_ids=ids, **kwargs).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


def test_image_prompts_get_their_own_forwards_tokens_beside_a_text_prompt_and_across_a_load(vl_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(vl_dir)
    engine = ContinuousBatchingEngine.from_pretrained(vl_dir)
    assert engine.rope is not None
    prompts = [image_prompt(tokenizer, (56, 56), 0, "12"), image_prompt(tokenizer, (40, 84), 1, "3345"),
               (tokenizer("987=")["input_ids"], None)]
    greedy = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    weights = {name: tensor.clone() for name, tensor in engine.model.state_dict().items()}

    async def main():
        together = await asyncio.gather(*[engine.generate(p, greedy, f"r{i}", vision_inputs=inputs)
                                          for i, (p, inputs) in enumerate(prompts)])
        # the same weights loaded as version 1 while the first prompt decodes: its rows are prefilled again
        spanning = asyncio.create_task(engine.generate(prompts[0][0], greedy, "span", vision_inputs=prompts[0][1]))
        while (engine.num_tokens("span") or 0) < 4:
            await asyncio.sleep(0.001)
        await engine.update_weights(list(weights.items()), version=1)
        spanning = await spanning
        await engine.close()
        return together, spanning

    together, spanning = run(main())
    model = engine.model
    for (prompt, inputs), result in zip(prompts, together):
        expected = own_forward_logprobs(model, prompt, inputs, result.token_ids)
        assert result.log_probs == pytest.approx(expected, abs=1e-4)
    # greedy: each token is the own forward's argmax (its log-prob is the row's largest)
    for (prompt, inputs), result in zip(prompts, together):
        ids = torch.tensor([prompt + result.token_ids])
        kwargs = {**inputs, "mm_token_type_ids": (ids == model.config.image_token_id).long()} if inputs else {}
        with torch.no_grad():
            argmax = model(input_ids=ids, **kwargs).logits[0, len(prompt) - 1 : -1].argmax(-1).tolist()
        assert result.token_ids == argmax
    # the images matter: without them (image tokens as plain embeddings, text positions) the forward differs
    blind = own_forward_logprobs(model, prompts[0][0], None, together[0].token_ids)
    assert max(abs(a - b) for a, b in zip(blind, together[0].log_probs)) > 1e-3
    assert len(set(together[0].token_ids + together[1].token_ids)) > 1  # not a degenerate model
    assert set(spanning.token_versions) == {0, 1}
    assert spanning.token_ids == together[0].token_ids  # the same weights: the re-prefill changed nothing
    assert spanning.log_probs == pytest.approx(together[0].log_probs, abs=1e-4)


def test_a_prompt_whose_image_tokens_do_not_match_its_images_fails_alone(vl_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(vl_dir)
    engine = ContinuousBatchingEngine.from_pretrained(vl_dir)
    prompt, inputs = image_prompt(tokenizer, (56, 56), 0, "12")
    short = [t for i, t in enumerate(prompt) if i != prompt.index(engine.rope.image_token_id)]

    async def main():
        good = asyncio.create_task(engine.generate(prompt, {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True},
                                                   "good", vision_inputs=inputs))
        with pytest.raises(ValueError, match="the prompt has 3 image tokens, its 1 image\\(s\\) fill 4"):
            await engine.generate(short, {"temperature": 0, "max_new_tokens": 4}, "bad", vision_inputs=inputs)
        result = await good
        await engine.close()
        return result

    assert len(run(main()).token_ids) == 4


def test_images_for_a_text_only_model_are_refused(tmp_path):
    import transformers

    transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32)).save_pretrained(tmp_path)
    engine = ContinuousBatchingEngine.from_pretrained(str(tmp_path))
    assert engine.rope is None

    async def main():
        with pytest.raises(ValueError, match="without a vision tower"):
            await engine.generate([1, 2], {"max_new_tokens": 2}, "r",
                                  vision_inputs={"pixel_values": torch.zeros(4, 6), "image_grid_thw": torch.ones(1, 3)})
        await engine.close()

    run(main())
