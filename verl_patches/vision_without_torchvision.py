"""Two patches: verl's image path runs where torchvision is missing (CPU runs).

These CPU machines have no torchvision that imports: the registry's wheel is a CUDA build
(`RuntimeError: operator torchvision::nms does not exist` against the CPU torch). Two pieces of verl's
image path need it although images never use it:

1. `patch_processors_without_torchvision`: transformers 5 builds the processors of Qwen2-VL,
   Qwen2.5-VL, Qwen3-VL, GLM-4V and GLM-4.6V with a video processor, and every video processor needs
   torchvision. `AutoProcessor.from_pretrained` raises, verl's `hf_processor` catches the error and
   returns None, and verl then runs the model as a text-only one without a word. Patched, such a
   processor takes `video_processor=None`: loading gives None for it, the image processor and tokenizer
   load as before; a video then fails in the processor's call.
2. `patch_qwen_vl_utils_without_torchvision`: verl's dataset and agent loops read a message's images
   with `qwen_vl_utils.process_vision_info`, whose module imports torchvision for its video readers.
   Patched, `qwen_vl_utils` is imported once with a stand-in for torchvision that exists only during
   that import (transformers never sees it); its image code runs unchanged, and a video fails naming
   torchvision.

The pipeline refuses video columns at start (`data.video_key`). Where torchvision imports, neither patch
does anything. Tested in tests/verl_patches/test_vision_without_torchvision.py.
"""

from __future__ import annotations

import functools
import sys
import types

VIDEO_PROCESSOR = "video_processor"  # the processor attribute (and modality) patch 1 lets be None
_MARK = "_async_rl_without_torchvision"
TORCHVISION_MODULES = ("torchvision", "torchvision.io", "torchvision.transforms")  # qwen_vl_utils' imports


def torchvision_missing() -> bool:
    from transformers.utils import is_torchvision_available

    return not is_torchvision_available()


class NoVideoProcessor:
    """Stands in for `AutoVideoProcessor` in transformers' processor loading: no video processor."""

    @classmethod
    def from_pretrained(cls, *args, **kwargs) -> None:
        return None


def patch_processors_without_torchvision() -> bool:
    """Patch 1 if torchvision is missing (idempotent); returns whether it is applied."""
    if not torchvision_missing():
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


class _NoTorchvision(types.ModuleType):
    """A name of torchvision's that `qwen_vl_utils` binds at import; using it raises, naming torchvision."""

    def __getattr__(self, name: str):
        if name == "__version__":  # the first thing qwen_vl_utils' video reader reads
            self()
        if name.startswith("__"):
            raise AttributeError(name)
        return _NoTorchvision(f"{self.__name__}.{name}")

    def __call__(self, *args, **kwargs):
        raise ImportError(f"{self.__name__} is not available: torchvision does not import here, so videos cannot "
                          "be read (images need no torchvision)")


def patch_qwen_vl_utils_without_torchvision() -> bool:
    """Patch 2 if torchvision is missing and `qwen_vl_utils` is installed (idempotent); returns whether
    `qwen_vl_utils` is now imported with the stand-in."""
    if "qwen_vl_utils" in sys.modules:
        return getattr(sys.modules["qwen_vl_utils"], _MARK, False)
    if not torchvision_missing():
        return False
    saved = {name: sys.modules.get(name) for name in TORCHVISION_MODULES}
    sys.modules.update({name: _NoTorchvision(name) for name in TORCHVISION_MODULES})
    try:
        import qwen_vl_utils
    except ImportError:
        return False
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    setattr(qwen_vl_utils, _MARK, True)
    return True
