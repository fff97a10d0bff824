"""Saving the student, and loading saved weights (a LoRA adapter or a full model) back into it."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import set_peft_model_state_dict
from safetensors.torch import load_file

from opd.errors import CheckpointError


def load_weights(model, model_dir: Path) -> None:
    """Load a saved adapter or full model's weights into the (possibly PEFT-wrapped) student.

    ``model_dir`` is a model directory, or a checkpoint holding one in ``model/``.
    """
    model_dir = Path(model_dir)
    if (model_dir / "model").is_dir():
        model_dir = model_dir / "model"
    adapter = model_dir / "adapter_model.safetensors"
    if not adapter.exists() and hasattr(model, "peft_config"):
        raise CheckpointError(
            f"{model_dir} holds a full model but the student is a LoRA model (lora_rank > 0)"
        )
    try:
        if adapter.exists():
            if not hasattr(model, "peft_config"):
                raise CheckpointError(
                    f"{model_dir} holds a LoRA adapter but the student is not a LoRA model"
                )
            set_peft_model_state_dict(model, load_file(adapter))
            return
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{model_dir}: no safetensors weights found")
        state = {}
        for file in files:
            state.update(load_file(file))
    except CheckpointError:
        raise
    except Exception as error:
        path = adapter if adapter.exists() else model_dir
        raise CheckpointError(
            f"weights in {path} are corrupt or truncated ({error}); load another checkpoint or "
            "model directory"
        ) from error
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = (
        {name for name in missing if "lm_head" in name}
        if model.config.tie_word_embeddings
        else set()
    )
    if unexpected or set(missing) - tied:
        raise CheckpointError(
            f"{model_dir}: weights do not match the student (missing "
            f"{sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]})"
        )
    with torch.no_grad():
        model.tie_weights()
