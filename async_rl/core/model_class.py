"""Which kind of model a transformers config describes: one with a vision tower (Qwen2-VL and its kind) or a
causal LM, and the auto class that builds it."""

from __future__ import annotations


def has_vision_tower(config) -> bool:
    """Whether `config` (a transformers config) describes a vision-language model (it has a `vision_config`)."""
    return getattr(config, "vision_config", None) is not None


def auto_model_class(config):
    """`AutoModelForImageTextToText` for a vision-language model's `config`, else `AutoModelForCausalLM`."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if has_vision_tower(config) else AutoModelForCausalLM
