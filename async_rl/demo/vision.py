"""A tiny vision-language model for tests: Qwen2-VL (multimodal RoPE) over the demo's tokenizer.

`save_vl_model(dir)` writes what a Hugging Face model directory holds: the model (random init, float32,
a 1-block vision tower, 2 text layers), the tokenizer with Qwen2-VL's vision tokens and a chat template
that places them, and the image processor (an image resized to about 56 x 56 pixels, its sides multiples
of 28: a square one is 16 patches of 14, 4 image tokens). `AutoProcessor` builds the processor from
these files (without torchvision, with verl_patches/vision_without_torchvision.py). `image_rows`: the
copy task's data with an image per row.
"""

from __future__ import annotations

from pathlib import Path

from async_rl.demo.task import make_rows
from async_rl.demo.tokenizer import IM_END_TOKEN, SEPARATOR, build_tokenizer

IMAGE_PLACEHOLDER = "<image>"  # where verl's dataset puts a row's image in its prompt

VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"
IMAGE_SIDE = 56  # pixels: the image processor resizes every image to about IMAGE_SIDE ** 2 pixels
PATCH, MERGE = 14, 2  # pixels per patch side; patches merged per image token side
INPUT_ONLY_MARGIN = 8.0  # see build_vl_model: the vision tokens' log-probs come out below -22

# the demo's chat template, with an image part rendered as Qwen2-VL's vision tokens
VL_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{{ message['content'] }}{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}" + VISION_START + IMAGE_PAD + VISION_END +
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{{ eos_token }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}" + SEPARATOR + "{%- endif -%}"
)


def build_vl_tokenizer():
    """The demo tokenizer plus Qwen2-VL's vision tokens, with `VL_CHAT_TEMPLATE`."""
    tokenizer = build_tokenizer(model_max_length=256, chat_template=VL_CHAT_TEMPLATE)
    tokenizer.add_special_tokens({"additional_special_tokens": [IM_END_TOKEN, VISION_START, IMAGE_PAD, VISION_END,
                                                                VIDEO_PAD]})
    return tokenizer


def build_image_processor():
    """Qwen2-VL's image processor, every image resized to about IMAGE_SIDE ** 2 pixels (aspect ratio kept)."""
    from transformers import Qwen2VLImageProcessor

    pixels = IMAGE_SIDE * IMAGE_SIDE
    return Qwen2VLImageProcessor(min_pixels=pixels, max_pixels=pixels, patch_size=PATCH, merge_size=MERGE,
                                 temporal_patch_size=2)


def build_vl_model(tokenizer, seed: int = 0):
    """Random-init tiny Qwen2VLForConditionalGeneration in float32 (head dim 32: RoPE sections 4 + 6 + 6; text
    weights wide enough that greedy tokens vary)."""
    import torch
    from transformers import GenerationConfig, Qwen2VLConfig, Qwen2VLForConditionalGeneration

    token = tokenizer.convert_tokens_to_ids
    config = Qwen2VLConfig(
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=len(tokenizer), max_position_embeddings=256,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id, initializer_range=0.2,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                         rope_parameters={"rope_type": "default", "mrope_section": [4, 6, 6], "rope_theta": 10000.0}),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=1, mlp_ratio=2, patch_size=PATCH,
                           spatial_merge_size=MERGE, temporal_patch_size=2, in_channels=3),
        image_token_id=token(IMAGE_PAD), video_token_id=token(VIDEO_PAD), vision_start_token_id=token(VISION_START),
        vision_end_token_id=token(VISION_END), tie_word_embeddings=True, dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config).to(torch.float32)
    # the vision tokens are input only, as in a trained model (verl's post-processing cannot take an image token
    # in a response): hidden dimension 0 of the residual stream is INPUT_ONLY_MARGIN at every position (every
    # token's embedding and every image feature start there, no layer writes it), and the vision tokens' rows of
    # the (tied) embedding hold its opposite, which puts their logits far below every other token's
    with torch.no_grad():
        embedding = model.get_input_embeddings().weight
        embedding[:, 0] = INPUT_ONLY_MARGIN
        embedding[[token(t) for t in (VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD)], 0] = -INPUT_ONLY_MARGIN
        for layer in model.model.language_model.layers:
            layer.self_attn.o_proj.weight[0].zero_()
            layer.mlp.down_proj.weight[0].zero_()
        merger = model.model.visual.merger.mlp[-1]  # the image features' last projection
        merger.weight[0].zero_()
        merger.bias[0] = INPUT_ONLY_MARGIN
    model.generation_config = GenerationConfig(bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    return model


def save_vl_model(directory: str | Path, seed: int = 0) -> Path:
    """Write the model, its tokenizer and its image processor to `directory`; returns it."""
    directory = Path(directory)
    tokenizer = build_vl_tokenizer()
    build_vl_model(tokenizer, seed).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    build_image_processor().save_pretrained(directory)
    return directory


def image_rows(prompts: list[str], split: str, seed: int = 0):
    """The copy task's rows (async_rl.demo.task.make_rows) with one random image each, before the digits:
    verl's `images` column (PNG bytes) and `<image>` in the prompt."""
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    rows = make_rows(prompts, split)
    images = []
    for _ in prompts:
        buffer = io.BytesIO()
        Image.fromarray((rng.random((IMAGE_SIDE, IMAGE_SIDE, 3)) * 255).astype("uint8")).save(buffer, format="PNG")
        images.append([{"bytes": buffer.getvalue()}])
    rows["images"] = images
    rows["prompt"] = [[{**message, "content": IMAGE_PLACEHOLDER + message["content"]} for message in prompt]
                      for prompt in rows["prompt"]]
    return rows
