"""verl_patches/processors_without_torchvision.py: on a machine without torchvision (this one), verl's
`hf_processor` gives a Qwen2-VL model's processor (images only) instead of None, with verl's multimodal
RoPE bound to it; a text-only model still gets none. One process, before and after the patch."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import json, sys, warnings
import numpy as np, torch
from PIL import Image
from transformers import AutoModelForImageTextToText
from verl.utils import hf_processor
from async_rl.demo.vision import IMAGE_PAD, save_vl_model
from verl_patches.cpu_patches import DRIVER_PATCHES_ON_IMPORT, PATCHES_ON_IMPORT
from verl_patches.processors_without_torchvision import patch_processors_without_torchvision

vl_dir, text_dir = str(save_vl_model(sys.argv[1])), sys.argv[2]
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    before = hf_processor(vl_dir)
applied = patch_processors_without_torchvision()
processor = hf_processor(vl_dir)
messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "12"}]}]
text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
image = Image.fromarray((np.random.default_rng(0).random((40, 72, 3)) * 255).astype("uint8"))
inputs = processor(text=[text], images=[image], return_tensors="pt")
ids = inputs["input_ids"]
image_token = processor.tokenizer.convert_tokens_to_ids(IMAGE_PAD)
types = (ids == image_token).long()
verls = processor.get_rope_index(input_ids=ids, mm_token_type_ids=types, image_grid_thw=inputs["image_grid_thw"])[0]
model = AutoModelForImageTextToText.from_pretrained(vl_dir)
models = model.model.get_rope_index(input_ids=ids, mm_token_type_ids=types, image_grid_thw=inputs["image_grid_thw"])[0]
json.dump({"before": repr(before), "applied": applied, "type": type(processor).__name__,
           "video_processor": repr(processor.video_processor), "image_tokens": int(types.sum()),
           "expected_image_tokens": int(inputs["image_grid_thw"].prod()) // 4, "pixel_values": list(inputs["pixel_values"].shape),
           "rope_equal": bool(torch.equal(verls, models)), "rope_rows": list(verls.shape),
           "text_model": repr(hf_processor(text_dir)),
           "registered": [PATCHES_ON_IMPORT.get("transformers.processing_utils") is patch_processors_without_torchvision,
                          DRIVER_PATCHES_ON_IMPORT.get("transformers.processing_utils") is patch_processors_without_torchvision]},
          sys.stdout)
"""


def test_a_vl_models_processor_loads_without_torchvision_and_a_text_models_still_has_none(demo_dir, tmp_path):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "vl"), str(demo_dir / "model")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["before"] == "None"  # verl would take the model for a text-only one
    assert result["applied"] is True  # torchvision is missing here
    assert result["type"] == "Qwen2VLProcessor" and result["video_processor"] == "None"
    assert result["image_tokens"] == result["expected_image_tokens"] > 1  # the image's tokens, expanded
    assert result["pixel_values"][0] > 0
    assert result["rope_equal"] and result["rope_rows"][0] == 3  # verl's bound RoPE index is the model's
    assert result["text_model"] == "None"
    assert result["registered"] == [True, True]  # in the workers (agent loops) and the driver (the data set)
