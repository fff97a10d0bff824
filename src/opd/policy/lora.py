"""LoRA on the student: adapters applied with PEFT, and folded into plain weights for samplers.

A sampler wants one weight per linear layer: ``W + scale * B @ A`` (as vLLM-based trainers
merge adapters before syncing weights), so each decode step runs one matmul per layer instead
of three and none of PEFT's per-layer Python.
"""

from __future__ import annotations

import warnings
from collections import Counter

import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from opd.logprobs import unwrap_peft
from opd.policy.config import StudentConfig


def apply_lora(model: nn.Module, student: StudentConfig) -> nn.Module:
    """Wrap in LoRA adapters (``lora_rank > 0``) or leave every weight trainable."""
    if student.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        if student.lora_rank > 0:
            model.enable_input_require_grads()
    if student.lora_rank == 0:
        model.requires_grad_(True)
        return model
    lora = LoraConfig(
        r=student.lora_rank,
        lora_alpha=student.lora_alpha if student.lora_alpha is not None else student.lora_rank,
        lora_dropout=student.lora_dropout,
        target_modules=student.lora_target_modules,
        task_type="CAUSAL_LM",
    )
    return quietly_peft(get_peft_model, model, lora)


def quietly_peft(call, *args, **kwargs):
    """``call(*args, **kwargs)`` without the FutureWarning peft raises on every LoRA model with
    transformers >= 5.2x (it reads ``is_gradient_checkpointing``, which transformers renamed): a
    word between two libraries' versions that no setting of the user's can change, printed on
    every run. Any other warning still shows."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", r".*is_gradient_checkpointing.* is deprecated", FutureWarning
        )
        return call(*args, **kwargs)


def adapter_delta(layer: nn.Module) -> torch.Tensor:
    """What a PEFT LoRA layer's active adapters add to its base weight."""
    return sum(layer.get_delta_weight(name) for name in layer.active_adapters)


def _is_plain_lora_layer(module: nn.Module) -> bool:
    """A PEFT LoRA layer whose active adapters are a plain ``scale * B @ A`` on its base weight."""
    base_weight = getattr(getattr(module, "base_layer", None), "weight", None)
    if not hasattr(module, "get_delta_weight") or not isinstance(base_weight, nn.Parameter):
        return False
    adapters = list(module.active_adapters)
    special = [
        getattr(module, flag, {}).get(name)
        for flag in ("use_dora", "lora_bias")
        for name in adapters
    ]
    return (
        bool(adapters)
        and not any(special)
        and not module.merged_adapters
        and not module.disable_adapters
    )


def mergeable_lora_layers(model: nn.Module, only: set[str] | None = None) -> dict[str, nn.Module]:
    """The PEFT LoRA layers (by module name) whose adapters fold into their base weight.

    A layer is left as it is when its base weight is shared with another module (a LoRA'd
    embedding tied to the lm head: merging would change the head too), when an adapter is
    already merged or disabled, or when it uses DoRA or a LoRA bias (not a plain weight sum).
    ``only``: look only at layers whose base weight's name is in it (the rest may be sharded).
    """
    use_count = Counter(
        id(parameter) for _, parameter in model.named_parameters(remove_duplicate=False)
    )
    layers = {}
    for name, module in model.named_modules():
        if only is not None and f"{name}.base_layer.weight" not in only:
            continue
        if _is_plain_lora_layer(module) and use_count[id(module.base_layer.weight)] == 1:
            with torch.no_grad():
                if adapter_delta(module).shape == module.base_layer.weight.shape:
                    layers[name] = module
    return layers


def sampling_view_name(name: str, merged: dict[str, nn.Module]) -> str | None:
    """A parameter's name once the ``merged`` layers are plain linear layers (None: it folds away).

    ``q_proj.base_layer.weight`` of a merged layer becomes ``q_proj.weight`` (holding the merged
    weight); its ``lora_A`` / ``lora_B`` vanish; every other name stays.
    """
    layer, _, rest = name.rpartition(".base_layer.")
    if layer in merged and rest:
        return f"{layer}.{rest}"
    if ".lora_" in name and name.split(".lora_", 1)[0] in merged:
        return None
    return name


@torch.no_grad()
def sampler_weights(
    model: nn.Module,
    dtype: torch.dtype,
    merged: dict[str, nn.Module] | None = None,
    only: set[str] | None = None,
):
    """``(name, tensor)`` for every floating-point weight a sampler of ``model`` needs, in
    ``dtype``.

    Names are those of the model without PEFT's wrapper, with the ``merged`` layers (default: every
    mergeable one) folded: their weight is ``W + scale * B @ A``. Other weights are cast, which
    shares their storage when they already are in ``dtype``. Tied weights come once. ``only``
    limits them to these parameter names (of the unwrapped model, before folding).
    """
    base = unwrap_peft(model)
    merged = mergeable_lora_layers(base, only) if merged is None else merged
    for name, parameter in base.named_parameters():
        if only is not None and name not in only:
            continue
        view_name = sampling_view_name(name, merged)
        if view_name is None or not parameter.is_floating_point():
            continue
        layer = merged.get(name.removesuffix(".base_layer.weight"))
        if layer is not None and name.endswith(".base_layer.weight"):
            weight = adapter_delta(layer)
            weight += layer.base_layer.weight
            yield view_name, weight.to(dtype)
        else:
            yield view_name, parameter.detach().to(dtype)
