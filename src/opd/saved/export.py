"""``opd export``: a run's student as a directory any Hugging Face user can load."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import yaml
from peft import PeftModel

from opd.assemble.student import load_student
from opd.config import config_from_dict
from opd.models import load_causal_lm, load_tokenizer
from opd.policy.lora import quietly_peft
from opd.runs.checkpoints import CheckpointError, latest_model_dir
from opd.runs.resume import CONFIG_NAME
from opd.runs.sharded_state import has_sharded_state, load_sharded_state


def export_student(run_dir: str | Path, out: str | Path, *, merge_lora: bool = False) -> Path:
    """Copy (or merge) the latest checkpoint's student into ``out``.

    A full fine-tune is copied as is. A LoRA run gives the adapter on its own (PEFT format,
    loadable with ``PeftModel.from_pretrained`` or ``AutoModelForCausalLM.from_pretrained``
    when peft is installed), or with ``merge_lora`` a plain model with the adapter merged in.
    A checkpoint of several processes (sharded) is gathered into this process first.
    """
    run_dir, out = Path(run_dir), Path(out)
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"{out}: exists and is not empty; choose a new output directory")
    model_dir = latest_model_dir(run_dir)
    config = yaml.safe_load((run_dir / CONFIG_NAME).read_text())
    if has_sharded_state(model_dir):
        with tempfile.TemporaryDirectory(prefix="opd-export-") as gathered:
            gathered_dir = gather_sharded_student(config, model_dir.parent, Path(gathered))
            return _export_model_dir(gathered_dir, config, out, merge_lora)
    return _export_model_dir(model_dir, config, out, merge_lora)


def gather_sharded_student(config: dict, checkpoint: Path, out: Path) -> Path:
    """A sharded checkpoint's student, gathered into one process and saved as a model directory."""
    run_config = config_from_dict(config)
    run_config.student.device = "cpu"
    student = load_student(run_config)
    load_sharded_state(checkpoint, student.policy)
    student.policy.save(out)
    student.tokenizer.save_pretrained(out)
    return out


def _export_model_dir(model_dir: Path, config: dict, out: Path, merge_lora: bool) -> Path:
    is_adapter = (model_dir / "adapter_config.json").exists()
    if not is_adapter or not merge_lora:
        shutil.copytree(model_dir, out, dirs_exist_ok=True)
        return out
    student = config["student"]
    base = load_causal_lm(
        student["model"],
        "student.model",
        dtype="float32",
        device="cpu",
        trust_remote_code=student["trust_remote_code"],
    )
    merged = quietly_peft(PeftModel.from_pretrained, base, model_dir).merge_and_unload()
    merged.save_pretrained(out, safe_serialization=True)
    load_tokenizer(str(model_dir), "student.tokenizer").save_pretrained(out)
    return out
