"""Weights and optimizer state as ``torch.distributed.checkpoint`` writes them: sharded, resharded
on load.

Entries are keyed by parameter name (``get_state_dict`` removes the DDP and FSDP wrappers from
the names), so a state written by N processes loads into M processes, or into one process
without any process group, and a one-process checkpoint's index-keyed optimizer state converts
to the same names. Under LoRA only the adapters are kept: the frozen base comes from
``student.model``.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from opd.distributed import world
from opd.errors import CheckpointError
from opd.policy.policy import Policy

STATE_DIR = "state"


def has_sharded_state(checkpoint: Path) -> bool:
    """Whether a checkpoint (or its ``model/`` directory) keeps its weights in ``state/``."""
    checkpoint = Path(checkpoint)
    if checkpoint.name == "model":
        checkpoint = checkpoint.parent
    return (checkpoint / STATE_DIR / ".metadata").exists()


def _options(policy: Policy, **extra) -> StateDictOptions:
    return StateDictOptions(
        ignore_frozen_params=policy.has_adapters, strict=not policy.has_adapters, **extra
    )


def save_sharded_state(directory: Path, policy: Policy, optimizer: torch.optim.Optimizer) -> None:
    """Write ``directory/state`` (every process its shards), and the model's config in
    ``model/``."""
    model_state, optimizer_state = get_state_dict(policy.model, optimizer, options=_options(policy))
    dcp.save(
        {"model": model_state, "optimizer": optimizer_state}, checkpoint_id=directory / STATE_DIR
    )
    if policy.has_adapters:
        policy.model.peft_config["default"].save_pretrained(directory / "model")
    else:
        policy.base_model.config.save_pretrained(directory / "model")


def load_sharded_state(
    checkpoint: Path, policy: Policy, optimizer: torch.optim.Optimizer | None = None
) -> None:
    """Load ``checkpoint/state`` into the policy (and the optimizer), resharded for this world."""
    checkpoint = Path(checkpoint)
    if checkpoint.name == "model":
        checkpoint = checkpoint.parent
    if optimizer is None:
        state = {"model": get_model_state_dict(policy.model, options=_options(policy))}
    else:
        model_state, optimizer_state = get_state_dict(
            policy.model, optimizer, options=_options(policy)
        )
        state = {"model": model_state, "optimizer": optimizer_state}
    try:
        dcp.load(state, checkpoint_id=checkpoint / STATE_DIR)
    except Exception as error:
        raise CheckpointError(
            f"{checkpoint / STATE_DIR}: cannot load the sharded state ({error}); the student "
            "(student.model, student.lora_rank) must be the one that wrote it"
        ) from error
    set_model_state_dict(policy.model, state["model"], options=_options(policy))
    if "optimizer" in state:
        set_optimizer_state_dict(
            policy.model, optimizer, state["optimizer"], options=_options(policy)
        )


def load_indexed_optimizer_state(
    policy: Policy, optimizer: torch.optim.Optimizer, saved: dict
) -> None:
    """Load a one-process checkpoint's optimizer state (keyed by parameter index) into any world.

    Index i is the i-th trainable parameter, in the order the optimizer was given them
    (:meth:`opd.policy.Policy.trainable_parameters`).
    """
    if world().size > 1:
        names = [
            name for name, parameter in policy.model.named_parameters() if parameter.requires_grad
        ]
        by_name = {
            "state": {names[index]: value for index, value in saved["state"].items()},
            "param_groups": [
                {**group, "params": [names[index] for index in group["params"]]}
                for group in saved["param_groups"]
            ],
        }
        set_optimizer_state_dict(
            policy.model, optimizer, by_name, options=_options(policy, full_state_dict=True)
        )
    else:
        optimizer.load_state_dict(saved)


def load_checkpoint_weights(policy: Policy, path: Path) -> None:
    """Load a checkpoint's (or a model directory's) weights, sharded or not, into ``policy``."""
    if has_sharded_state(path):
        load_sharded_state(path, policy)
    else:
        policy.load_weights(path)
