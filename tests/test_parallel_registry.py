"""Parallel modes are registered components: a new one is one class in one module, and the config,
the dry-run plan, the process checks and the trainer take it by its name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from opd.assemble.processes import resolve_parallel
from opd.config import ConfigError, config_from_dict
from opd.policy.parallel import parallel_modes
from opd.policy.parallel.base import REGISTRY, ParallelMode
from opd.trainer.loop import Trainer
from opd.trainer.plan import describe_plan


class CountingForward(nn.Module):
    """The scored forward, counting its calls."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.inner = module
        self.calls = 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)


@pytest.fixture
def new_modes():
    """Two modes declared here, as a module of opd.policy.parallel would declare them; removed
    after."""

    class Counting(ParallelMode):
        name = "counting_test"

        def placement(self, processes: int) -> str:
            return "one process, its forwards counted"

        def wrap(self, module, model, device):
            return CountingForward(module)

    class Replicas(ParallelMode):
        name = "replicas_test"
        several_processes = True

        def placement(self, processes: int) -> str:
            return f"a test replica in each of {processes} processes"

    parallel_modes.cache_clear()
    yield
    for name in ("counting_test", "replicas_test"):
        REGISTRY.pop(name)
    parallel_modes.cache_clear()


def test_the_built_in_modes_are_registered_none_first():
    assert list(parallel_modes()) == ["none", "ddp", "fsdp"]


def test_a_new_mode_is_one_class_the_trainer_runs_by_its_name(new_modes, base_config):
    base_config["training"].update(parallel="counting_test", max_steps=1)
    trainer = Trainer(config_from_dict(base_config), progress=False)
    assert isinstance(trainer.parts.policy.module, CountingForward)
    before = [p.detach().clone() for p in trainer.parts.policy.trainable_parameters()]
    trainer.learn(trainer.collect(0))
    assert trainer.parts.policy.module.calls > 0  # the update ran through the mode's wrapper
    after = list(trainer.parts.policy.trainable_parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_a_new_mode_is_checked_and_planned_by_its_name(new_modes, base_config):
    config = config_from_dict(base_config, ["training.parallel=replicas_test"])
    plan = describe_plan(config, 2)
    assert "(training.parallel: replicas_test)" in plan
    assert "a test replica in each of 2 processes" in plan
    with pytest.raises(ConfigError, match="replicas_test needs several processes and this is one"):
        resolve_parallel("replicas_test", 1)
    with pytest.raises(ConfigError, match="use ddp, fsdp, replicas_test or auto"):
        resolve_parallel("counting_test", 2)
    with pytest.raises(
        ConfigError, match=r"training\.parallel: 'replica_test' is not one of .*did you mean"
    ):
        config_from_dict(base_config, ["training.parallel=replica_test"])
