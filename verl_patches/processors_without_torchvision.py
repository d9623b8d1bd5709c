"""One patch: vision-language processors load without torchvision, for images only (CPU runs).

transformers 5 builds the processors of Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4V and GLM-4.6V with a
video processor, and every video processor needs torchvision. Without it `AutoProcessor.from_pretrained`
raises, verl's `hf_processor` catches the error and returns None, and verl then runs the model as a
text-only one without a word. These CPU machines have no torchvision that imports: the registry's
wheel is a CUDA build (`RuntimeError: operator torchvision::nms does not exist` against the CPU torch).
Where torchvision is missing this lets such a processor take `video_processor=None`: loading gives
None for it, the image processor and tokenizer load as before. A video then fails in the processor's
call; the pipeline refuses video columns at start (`data.video_key`). Where torchvision imports,
nothing changes. Tested in tests/verl_patches/test_processors_without_torchvision.py.
"""

from __future__ import annotations

import functools

VIDEO_PROCESSOR = "video_processor"  # the processor attribute (and modality) this patch lets be None
_MARK = "_async_rl_without_torchvision"


class NoVideoProcessor:
    """Stands in for `AutoVideoProcessor` in transformers' processor loading: no video processor."""

    @classmethod
    def from_pretrained(cls, *args, **kwargs) -> None:
        return None


def patch_processors_without_torchvision() -> bool:
    """Apply the patch if torchvision is missing (idempotent); returns whether it is applied."""
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():
        return False
    import transformers.processing_utils as processing

    mixin = processing.ProcessorMixin
    if getattr(mixin, _MARK, False):
        return True
    check = mixin.check_argument_for_proper_class

    @functools.wraps(check)
    def check_argument_for_proper_class(self, argument_name, argument):
        if argument is None and processing._get_modality_for_attribute(argument_name) == VIDEO_PROCESSOR:
            return None
        return check(self, argument_name, argument)

    mixin.check_argument_for_proper_class = check_argument_for_proper_class
    mapping = processing.MODALITY_TO_AUTOPROCESSOR_MAPPING  # lazy: (module, name) per modality
    mapping._MAPPING_NAMES = {**mapping._MAPPING_NAMES, VIDEO_PROCESSOR: (__name__, NoVideoProcessor.__name__)}
    setattr(mixin, _MARK, True)
    return True
