"""TRL's DistillationTrainer set up to do the same work as opd, shared by the benches."""

from __future__ import annotations


def distillation_config(output_dir: str, **settings):
    """A ``DistillationConfig`` in float32 without recomputation (TRL defaults to bf16 autocast and
    gradient checkpointing; opd runs neither), with logging and saving off; ``settings`` add the
    rest or override those two."""
    from trl import DistillationConfig

    return DistillationConfig(
        output_dir=output_dir,
        logging_steps=1000,
        save_strategy="no",
        report_to="none",
        **({"bf16": False, "gradient_checkpointing": False} | settings),
    )


def lora_config(rank: int):
    """LoRA on every linear layer with alpha = rank, as opd's ``lora_rank`` builds it."""
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=rank, target_modules="all-linear", task_type="CAUSAL_LM")
