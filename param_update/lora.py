"""LoRA over the weight sync: the adapter's tensors travel, the receiver serves merged weights.

Under LoRA only the adapters train (the base weights are frozen, and every process loads the same
base from `actor_rollout_ref.model.path`), so a version is its adapter tensors alone: `lora_A`
(r x in) and `lora_B` (out x r) per adapted Linear, a few percent of the model's bytes. A receiver
that serves plain weights (the CPU rollout server) keeps its own copy of the base weights it loaded
and serves, for every adapted Linear,

    served = base + (lora_B @ lora_A) * scaling

which is PEFT's merge (`LoraLayer.get_delta_weight`, `merge`), computed in the base weight's dtype.
A receiver that is itself a PEFT model (the logp workers) loads the adapter tensors as they are.

Names: an adapter tensor is sent under the name PEFT's `get_peft_model_state_dict` gives it
(`base_model.model.<module>.lora_A.weight`), the served weight is `<module>.weight` (the HF name).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Optional

import torch

PEFT_PREFIX = "base_model.model."
ADAPTER_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


class LoraError(ValueError):
    """A LoRA adapter the weight sync cannot merge (an unsupported kind of layer, a missing tensor)."""


@dataclass(frozen=True)
class AdaptedLinear:
    """One adapted Linear: its served weight's HF name, the two adapter tensors' sent names, and its
    scaling (`lora_alpha / r`, or `/ sqrt(r)` with rsLoRA, as PEFT set it on the layer)."""

    weight: str
    lora_a: str
    lora_b: str
    scaling: float


@dataclass(frozen=True)
class LoraAdapter:
    """The trainer's adapter as the receivers must apply it (picklable; sent once, at start); layers in
    the order of their weights' names."""

    layers: tuple[AdaptedLinear, ...]
    # PEFT's config of the adapter as a dict (`LoraConfig.to_dict()`): what a backend that serves adapters
    # itself is given with each version (verl's `peft_config`, vLLM's `add_lora`)
    peft_config: Optional[dict] = field(default=None, compare=False)

    @property
    def sent_names(self) -> list[str]:
        return [name for layer in self.layers for name in (layer.lora_a, layer.lora_b)]

    @property
    def weights(self) -> list[str]:
        """HF names of the weights a version changes."""
        return [layer.weight for layer in self.layers]

    def merged(self, base: Mapping[str, torch.Tensor], sent: Mapping[str, torch.Tensor]
               ) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, base + (B @ A) * scaling) of every adapted weight, new tensors (base untouched)."""
        for layer in self.layers:
            yield layer.weight, merge_linear(base[layer.weight], sent[layer.lora_a], sent[layer.lora_b], layer.scaling)


def merge_linear(base: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """PEFT's merged Linear weight: `base + (lora_b @ lora_a) * scaling`, in base's dtype (out x in)."""
    if lora_b.shape[0] != base.shape[0] or lora_a.shape[1] != base.shape[1] or lora_a.shape[0] != lora_b.shape[1]:
        raise LoraError(f"adapter shapes A {tuple(lora_a.shape)}, B {tuple(lora_b.shape)} do not fit a weight of "
                        f"shape {tuple(base.shape)}")
    with torch.no_grad():
        delta = lora_b.to(base.dtype) @ lora_a.to(base.dtype)
        return base.detach() + delta * scaling


def served_name(module_name: str) -> str:
    """HF name of the weight a PEFT module `module_name` (`base_model.model.<module>`) serves."""
    return f"{module_name.removeprefix(PEFT_PREFIX)}.weight"


def adapter_of(peft_model: torch.nn.Module, adapter: str = "default") -> LoraAdapter:
    """The `LoraAdapter` of a PEFT model (unwrapped from FSDP or not): every LoRA layer must adapt a
    `torch.nn.Linear` with a plain (not DoRA) adapter; anything else raises LoraError naming it."""
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    layers = []
    for name, module in peft_model.named_modules():
        if not isinstance(module, LoraLayer) or adapter not in module.scaling:
            continue
        if not isinstance(module, LoraLinear) or not isinstance(module.get_base_layer(), torch.nn.Linear):
            raise LoraError(f"LoRA on {name} ({type(module.get_base_layer()).__name__}): the weight sync merges "
                            "adapters of Linear layers only (set target_modules to Linear layers)")
        if module.use_dora.get(adapter, False):
            raise LoraError(f"DoRA on {name}: the weight sync merges plain LoRA adapters only")
        if getattr(module, "fan_in_fan_out", False):
            raise LoraError(f"fan_in_fan_out on {name}: the weight sync merges (out x in) Linear weights only")
        layers.append(AdaptedLinear(served_name(name), f"{name}.lora_A.weight", f"{name}.lora_B.weight",
                                    float(module.scaling[adapter])))
    if not layers:
        raise LoraError("the model has no LoRA layer (target_modules matched nothing)")
    return LoraAdapter(tuple(sorted(layers, key=lambda layer: layer.weight)),
                       peft_config=peft_model.peft_config[adapter].to_dict())


def sent_name(module_key: str, adapter: str = "default") -> str:
    """The sent name of an adapter parameter of a PEFT model's state dict (`...lora_A.default.weight` ->
    `...lora_A.weight`, as `get_peft_model_state_dict` names it); other keys unchanged."""
    return module_key.replace(f".lora_A.{adapter}.", ".lora_A.").replace(f".lora_B.{adapter}.", ".lora_B.")


def is_adapter_key(name: str) -> bool:
    return name.endswith(ADAPTER_SUFFIXES) or ".lora_A." in name or ".lora_B." in name


def base_weights(state: Mapping[str, torch.Tensor], adapter: LoraAdapter) -> dict[str, torch.Tensor]:
    """HF name -> a private copy of each weight `adapter` changes, from a plain model's state dict `state`
    (what a receiver merges onto). Raises LoraError naming a weight the model lacks."""
    missing = [name for name in adapter.weights if name not in state]
    if missing:
        raise LoraError(f"the adapter changes {missing[:3]}, which this model does not have")
    return {name: state[name].detach().clone() for name in adapter.weights}


def served_state(named: Iterable[tuple[str, torch.Tensor]], adapter: LoraAdapter) -> dict[str, torch.Tensor]:
    """HF name -> the weights a receiver serves, from a PEFT model's named tensors (module keys, any
    prefix `base_model.model.`, base layers as `.base_layer.`): base weights with every adapted one
    merged. What the trainer's digests are computed on."""
    base, sent = {}, {}
    for key, tensor in named:
        name = sent_name(key)
        if is_adapter_key(name):
            sent[name] = tensor
        else:
            base[name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")] = tensor
    merged = dict(adapter.merged(base, sent))
    return {name: merged.get(name, tensor) for name, tensor in base.items()}


def adapter_from_peft_config(peft_config: Mapping, sent_names: Iterable[str]) -> LoraAdapter:
    """The `LoraAdapter` of adapter tensors named `sent_names` under PEFT's config dict `peft_config`
    (what verl's own trainer sends a rollout with its adapter: `r`, `lora_alpha`, `use_rslora`). Per-module
    ranks or alphas (`rank_pattern`, `alpha_pattern`) and DoRA raise LoraError."""
    for key in ("rank_pattern", "alpha_pattern"):
        if peft_config.get(key):
            raise LoraError(f"a LoRA adapter with {key}={peft_config[key]!r}: the CPU rollout merges one "
                            "rank and alpha for every layer")
    if peft_config.get("use_dora"):
        raise LoraError("DoRA: the CPU rollout merges plain LoRA adapters only")
    rank, alpha = int(peft_config["r"]), float(peft_config["lora_alpha"])
    scaling = alpha / rank ** 0.5 if peft_config.get("use_rslora") else alpha / rank
    modules = sorted({name.removesuffix(suffix) for name in sent_names for suffix in ADAPTER_SUFFIXES
                      if name.endswith(suffix)})
    return LoraAdapter(tuple(AdaptedLinear(served_name(m), f"{m}.lora_A.weight", f"{m}.lora_B.weight", scaling)
                             for m in modules), peft_config=dict(peft_config))


class MergedVersion:
    """A staged adapter version as the weights it serves: what a load puts in place of the adapted
    weights (`swap_into` / `copy_into`, the calls of param_update.staging.VersionStager; the merged
    tensors are new memory either way, so both set them). The staged buckets are released."""

    def __init__(self, merged: Mapping[str, torch.Tensor], stager):
        self.merged = dict(merged)
        self.stager = stager

    def swap_into(self, params: Mapping[str, torch.Tensor]) -> None:
        for name, tensor in self.merged.items():
            params[name].data = tensor
        self.stager.reset()

    def copy_into(self, params: Mapping[str, torch.Tensor], consume_bytes: int) -> int:
        self.swap_into(params)
        return sum(t.nbytes for t in self.merged.values())
