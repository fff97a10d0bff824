"""Half-precision students train through float32 master weights (opd.assemble.optimizer): the
float32 copy follows torch's AdamW exactly, the weights are its rounding, resume is exact, and
FSDP2's shards update as one process does."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from opd.assemble.optimizer import MasterWeightAdamW, adamw
from opd.config import config_from_dict
from opd.trainer.loop import Trainer
from tests.master_weights_worker import model, train

WORKER = Path(__file__).with_name("master_weights_worker.py")
SETTINGS = {"lr": 3e-5, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def grads(count: int, shape: tuple[int, ...]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=generator) * 1e-2 for _ in range(count)]


def steps(
    optimizer: torch.optim.Optimizer, parameter: torch.Tensor, given: list[torch.Tensor]
) -> None:
    for grad in given:
        parameter.grad = grad.to(parameter.dtype)
        optimizer.step()
        optimizer.zero_grad()


def test_the_master_copy_follows_torchs_adamw_in_float32_and_the_weights_are_its_rounding():
    start = torch.randn(64, 64, generator=torch.Generator().manual_seed(1)) * 0.03
    half = torch.nn.Parameter(start.bfloat16())
    full = torch.nn.Parameter(half.detach().float())
    given = grads(10, (64, 64))
    optimizer = adamw([half], **SETTINGS)
    assert isinstance(optimizer, MasterWeightAdamW)
    steps(optimizer, half, [g.bfloat16().float() for g in given])
    steps(
        torch.optim.AdamW([full], foreach=False, **SETTINGS),
        full,
        [g.bfloat16().float() for g in given],
    )
    master = optimizer.state[half]["master"]
    assert master.dtype == torch.float32 and optimizer.state[half]["exp_avg"].dtype == torch.float32
    assert torch.equal(master, full.detach())
    assert torch.equal(half.detach(), master.bfloat16())
    moved = (half.detach() != start.bfloat16()).float().mean().item()
    plain = torch.nn.Parameter(start.bfloat16())
    steps(torch.optim.AdamW([plain], **SETTINGS), plain, given)
    stuck = (plain.detach() == start.bfloat16()).float().mean().item()
    assert moved > 0.5 and stuck > 0.5, (moved, stuck)  # in plain bfloat16 most weights never move


def test_float32_parameters_beside_half_ones_are_updated_as_adamw_updates_them():
    a, b = (
        torch.nn.Parameter(torch.ones(8)),
        torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16)),
    )
    reference = torch.nn.Parameter(torch.ones(8))
    optimizer = adamw([a, b], **SETTINGS)
    plain = torch.optim.AdamW([reference], **(SETTINGS | {"fused": True}))
    for grad in grads(3, (8,)):
        a.grad, b.grad, reference.grad = grad, grad.bfloat16(), grad.clone()
        optimizer.step()
        plain.step()
    assert torch.equal(a.detach(), reference.detach())
    assert "master" not in optimizer.state[a]
    assert torch.allclose(optimizer.state[b]["master"], reference.detach(), atol=1e-6)


def test_a_resumed_optimizer_goes_on_from_the_same_float32_weights():
    given = grads(6, (32,))
    whole = torch.nn.Parameter(torch.full((32,), 0.05, dtype=torch.bfloat16))
    steps(adamw([whole], **SETTINGS), whole, given)
    first = torch.nn.Parameter(torch.full((32,), 0.05, dtype=torch.bfloat16))
    optimizer = adamw([first], **SETTINGS)
    steps(optimizer, first, given[:3])
    saved = optimizer.state_dict()
    assert "master" in saved["state"][0]
    second = torch.nn.Parameter(first.detach().clone())
    resumed = adamw([second], **SETTINGS)
    resumed.load_state_dict(saved)
    steps(resumed, second, given[3:])
    assert torch.equal(second.detach(), whole.detach())


def test_fsdp2_shards_of_a_bfloat16_model_update_as_one_process(tmp_path):
    out = tmp_path / "found.json"
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(WORKER), str(out)],
        capture_output=True, text=True, timeout=300,
        env=os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(WORKER.parent.parent)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(out.read_text())
    alone = model()
    optimizer = train(alone)
    for name, parameter in alone.named_parameters():
        assert found[name]["dtype"] == "torch.bfloat16"
        master = torch.tensor(found[name]["master"])
        assert master == pytest.approx(optimizer.state[parameter]["master"], abs=1e-7), name
        assert torch.equal(torch.tensor(found[name]["parameter"]).bfloat16(), master.bfloat16()), (
            name
        )


def test_a_bfloat16_student_trains_through_master_weights_and_resumes_exactly(
    base_config, tmp_path
):
    """Two steps, then the run extended to four, equal four steps at once: the checkpoint kept the
    float32 master weights (a resume from the bfloat16 weights alone would part at step 3)."""
    base_config["student"].update(dtype="bfloat16", device="cpu")
    base_config["training"].update(learning_rate=3e-4, lr_schedule="constant", warmup_steps=0)

    def run(name: str, *max_steps: int) -> tuple[list[dict], dict[str, torch.Tensor]]:
        config = dict(base_config, log_path=str(tmp_path / name))
        rows = []
        for steps_ in max_steps:
            config["training"] = dict(config["training"], max_steps=steps_)
            trainer = Trainer(config_from_dict(config), progress=False)
            assert isinstance(trainer.parts.optimizer, MasterWeightAdamW)
            rows += trainer.run().metrics
        return rows, {
            name: p.detach().clone() for name, p in trainer.parts.policy.model.named_parameters()
        }

    whole_rows, whole = run("whole", 4)
    split_rows, split = run("split", 2, 4)
    assert [r["step"] for r in split_rows] == [0, 1, 2, 3]
    assert [r["teacher_kl"] for r in split_rows] == [r["teacher_kl"] for r in whole_rows]
    assert all(torch.equal(split[name], whole[name]) for name in whole)
    assert all(p.dtype == torch.bfloat16 for p in whole.values())
