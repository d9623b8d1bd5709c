"""verl_patches/vision_without_torchvision.py on this machine, where torchvision does not import: verl's
`hf_processor` gives a Qwen2-VL model's processor (images only) instead of None, with verl's multimodal
RoPE bound to it, and a text-only model still gets none; `qwen_vl_utils`, which verl reads a message's
images with, imports and reads images while transformers still sees no torchvision, and a video fails
naming torchvision. One process, before and after the patches."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import json, sys, warnings
import numpy as np, torch
from PIL import Image
from transformers import AutoModelForImageTextToText
from transformers.utils import is_torchvision_available
from verl.utils import hf_processor
from async_rl.demo.vision import IMAGE_PAD, save_vl_model
from verl_patches.cpu_patches import DRIVER_PATCHES_ON_IMPORT, PATCHES_ON_IMPORT
from verl_patches.vision_without_torchvision import (patch_processors_without_torchvision,
                                                     patch_qwen_vl_utils_without_torchvision)

vl_dir, text_dir = str(save_vl_model(sys.argv[1])), sys.argv[2]
result = {"torchvision": is_torchvision_available()}
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    result["processor_before"] = repr(hf_processor(vl_dir))
try:
    import qwen_vl_utils
    result["qwen_vl_utils_before"] = "imported"
except ImportError as error:
    result["qwen_vl_utils_before"] = str(error)
result["applied"] = [patch_processors_without_torchvision(), patch_qwen_vl_utils_without_torchvision()]
processor = hf_processor(vl_dir)
image = Image.fromarray((np.random.default_rng(0).random((40, 72, 3)) * 255).astype("uint8"))
from qwen_vl_utils import process_vision_info
messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "12"}]}]
images, videos = process_vision_info(messages, image_patch_size=14)
text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
inputs = processor(text=[text], images=images, return_tensors="pt")
ids = inputs["input_ids"]
types = (ids == processor.tokenizer.convert_tokens_to_ids(IMAGE_PAD)).long()
verls = processor.get_rope_index(input_ids=ids, mm_token_type_ids=types, image_grid_thw=inputs["image_grid_thw"])[0]
model = AutoModelForImageTextToText.from_pretrained(vl_dir)
models = model.model.get_rope_index(input_ids=ids, mm_token_type_ids=types, image_grid_thw=inputs["image_grid_thw"])[0]
try:
    process_vision_info([{"role": "user", "content": [{"type": "video", "video": "file:///clip.mp4"}]}])
    result["video"] = "read"
except ImportError as error:
    result["video"] = str(error)
result.update({
    "type": type(processor).__name__, "video_processor": repr(processor.video_processor),
    "read_images": [list(i.size) for i in images], "read_videos": repr(videos),
    "image_tokens": int(types.sum()), "expected_image_tokens": int(inputs["image_grid_thw"].prod()) // 4,
    "rope_equal": bool(torch.equal(verls, models)), "rope_rows": list(verls.shape),
    "text_model": repr(hf_processor(text_dir)), "torchvision_after": is_torchvision_available(),
    "torchvision_module_left": "torchvision" in sys.modules,
    "registered": [PATCHES_ON_IMPORT.get(module) is patch and DRIVER_PATCHES_ON_IMPORT.get(module) is patch
                   for module, patch in (("transformers.processing_utils", patch_processors_without_torchvision),
                                         ("verl.utils.dataset.rl_dataset", patch_qwen_vl_utils_without_torchvision))],
})
json.dump(result, sys.stdout)
"""


def test_verls_image_path_runs_without_torchvision(demo_dir, tmp_path):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "vl"), str(demo_dir / "model")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["torchvision"] is False  # what the patches are for
    assert result["processor_before"] == "None"  # verl would take the model for a text-only one
    assert "torchvision" in result["qwen_vl_utils_before"]  # verl could not read a row's image
    assert result["applied"] == [True, True]
    assert result["type"] == "Qwen2VLProcessor" and result["video_processor"] == "None"
    assert result["read_images"] == [[84, 56]] and result["read_videos"] == "None"  # resized to 28's multiples
    assert result["image_tokens"] == result["expected_image_tokens"] > 1  # the image's tokens, expanded
    assert result["rope_equal"] and result["rope_rows"][0] == 3  # verl's bound RoPE index is the model's
    assert result["text_model"] == "None"
    assert "torchvision does not import here, so videos cannot be read" in result["video"]
    assert result["torchvision_after"] is False and result["torchvision_module_left"] is False
    assert result["registered"] == [True, True]  # in the workers (agent loops) and the driver (the data set)
