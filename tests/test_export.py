"""Export round-trips: the exported model gives the trained student's logits."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from opd.cli import main
from opd.config import config_from_dict
from opd.trainer.loop import train

IDS = torch.tensor([[1, 5, 6, 7, 8, 2]])


def logits(model):
    with torch.no_grad():
        return model.eval()(IDS).logits


@pytest.mark.parametrize(("lora_rank", "merge"), [(0, False), (4, True), (4, False)])
def test_export_round_trips(base_config, tmp_path, model_dirs, lora_rank, merge):
    base_config["student"]["lora_rank"] = lora_rank
    base_config["training"]["learning_rate"] = 1e-2
    result = train(config_from_dict(base_config), progress=False)
    out = tmp_path / "exported"
    assert (
        main(["export", str(tmp_path / "run"), str(out), *(["--merge-lora"] if merge else [])]) == 0
    )
    exported = AutoModelForCausalLM.from_pretrained(out)
    torch.testing.assert_close(logits(exported), logits(result.student), atol=1e-5, rtol=1e-5)
    untrained = AutoModelForCausalLM.from_pretrained(model_dirs["student"])
    assert not torch.allclose(logits(exported), logits(untrained), atol=1e-4)
    assert (out / "tokenizer.json").exists()
    if lora_rank and not merge:
        assert (out / "adapter_model.safetensors").exists()


def test_export_refuses_a_non_empty_output(base_config, tmp_path, capsys):
    train(config_from_dict(base_config), progress=False)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "busy")]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
