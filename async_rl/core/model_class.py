"""The transformers auto class that builds a model from its config: the image-text one for a model with a
vision tower (Qwen2-VL and its kind), else the causal LM one."""

from __future__ import annotations


def auto_model_class(config):
    """`AutoModelForImageTextToText` if `config` (a transformers config) has a `vision_config`, else
    `AutoModelForCausalLM`."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM
