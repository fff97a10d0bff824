"""The training loop on tiny random models: invariants, bad input, LoRA, CLI."""

import json
import math
import warnings
from functools import partial

import pytest
import torch
import yaml
from peft import PeftModel
from transformers import AutoModelForCausalLM

from opd.assemble.optimizer import lr_factor
from opd.cli import main
from opd.config import ConfigError, config_from_dict
from opd.demo.char_tokenizer import build_char_tokenizer
from opd.models import ModelLoadError
from opd.runs.checkpoints import latest_model_dir
from opd.runs.metrics import read_jsonl
from opd.teachers.base import TeacherScores
from opd.trainer.loop import Trainer, train
from tests.conftest import tiny_llama

REQUIRED_METRICS = {
    "step",
    "teacher_kl",
    "teacher_kl/rev",
    "entropy",
    "kl_sample_train",
    "num_tokens",
    "completion_len_mean",
    "frac_truncated",
    "lr",
    "grad_norm",
    "time/sample",
    "time/teacher",
    "time/train",
    "time/total",
}


def test_teacher_equal_to_student_gives_zero_kl_and_unit_ratio(base_config, model_dirs):
    base_config["teacher"]["model"] = str(model_dirs["student"])
    trainer = Trainer(config_from_dict(base_config), progress=False)
    batch, source = trainer.collector.sample_batch(0)
    assert source == "student"
    teacher_logprobs = trainer.parts.teachers.score(batch).logprobs_BT
    mask = batch.mask_BT.bool()
    torch.testing.assert_close(
        teacher_logprobs[mask], batch.sampled_logprobs_BT[mask], atol=1e-5, rtol=0
    )
    metrics = trainer.train_step(0)
    assert abs(metrics["teacher_kl"]) < 1e-5
    assert abs(metrics["kl_sample_train"]) < 1e-5
    assert metrics["grad_norm"] < 1e-4  # zero advantages: nothing to learn


def test_run_writes_every_metric_and_the_student(base_config):
    result = train(config_from_dict(base_config), progress=False)
    rows = read_jsonl(result.log_path / "metrics.jsonl")
    assert [row["step"] for row in rows] == [0, 1]
    for row in rows:
        assert row.keys() >= REQUIRED_METRICS, REQUIRED_METRICS - row.keys()
        assert math.isfinite(row["teacher_kl"]) and row["teacher_kl/rev"] == row["teacher_kl"]
        assert row["num_tokens"] > 0 and row["skipped"] == 0
    assert (result.log_path / "config.yaml").exists()
    reloaded = AutoModelForCausalLM.from_pretrained(latest_model_dir(result.log_path))
    for name, param in reloaded.state_dict().items():
        torch.testing.assert_close(param, result.student.state_dict()[name])


def test_one_pass_over_the_shortest_dataset_without_max_steps(base_config):
    base_config["training"]["max_steps"] = None
    trainer = Trainer(config_from_dict(base_config), progress=False)
    assert trainer.parts.num_steps == 4  # 8 prompts, 2 per batch


def test_substeps_take_one_optimizer_step_each(base_config):
    base_config["training"].update(num_substeps=2, micro_batch_size=1, max_steps=1)
    trainer = Trainer(config_from_dict(base_config), progress=False)
    trainer.train_step(0)
    states = [s["step"] for s in trainer.parts.optimizer.state.values()]
    assert states and all(int(s) == 2 for s in states)


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [
        ("constant", [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]),
        # 2 warmup steps, then 4 decay steps (progress 0, 1/4, 1/2, 3/4); step 6 is past the end
        ("linear", [0.5, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0]),
        ("cosine", [0.5, 1.0, 1.0, 0.853553, 0.5, 0.146447, 0.0]),  # (1 + cos(pi * progress)) / 2
    ],
)
def test_lr_factor_warms_up_then_follows_the_schedule(schedule, expected):
    factors = [
        lr_factor(step, warmup_steps=2, total_steps=6, schedule=schedule) for step in range(7)
    ]
    assert factors == pytest.approx(expected, abs=1e-6)


def test_logged_lr_decays_over_the_run_with_substeps(base_config):
    base_config["training"].update(
        lr_schedule="linear", warmup_steps=1, max_steps=3, num_substeps=2, micro_batch_size=1
    )
    result = train(config_from_dict(base_config), progress=False)
    logged = [row["lr"] for row in read_jsonl(result.log_path / "metrics.jsonl")]
    # 6 optimizer steps, 1 of warmup: factors 1, 1, 4/5, 3/5, 2/5, 1/5; a step logs its first one's
    assert logged == pytest.approx([1e-3, 8e-4, 4e-4], abs=1e-12)


def test_micro_batches_give_the_same_gradient_as_one_batch(base_config):
    """Plain SGD with lr 1: the parameter change is exactly minus the accumulated gradient."""
    changes = []
    for micro in (None, 1):
        base_config["training"].update(micro_batch_size=micro, max_steps=1, max_grad_norm=None)
        trainer = Trainer(config_from_dict(base_config), progress=False)
        trainer.parts.optimizer = torch.optim.SGD(trainer.parts.student.parameters(), lr=1.0)
        trainer.parts.scheduler = torch.optim.lr_scheduler.LambdaLR(
            trainer.parts.optimizer, lambda _: 1.0
        )
        before = {k: v.detach().clone() for k, v in trainer.parts.student.named_parameters()}
        trainer.train_step(0)
        changes.append(
            {k: v.detach() - before[k] for k, v in trainer.parts.student.named_parameters()}
        )
    assert any(change.abs().max() > 1e-4 for change in changes[0].values())
    for name, change in changes[0].items():
        torch.testing.assert_close(change, changes[1][name], atol=1e-6, rtol=1e-4, msg=name)


def test_gradients_are_freed_after_every_substep(base_config):
    base_config["training"]["num_substeps"] = 2
    trainer = Trainer(config_from_dict(base_config), progress=False)
    metrics = trainer.train_step(0)
    assert metrics["skipped"] == 0 and trainer.parts.optimizer.state
    assert all(p.grad is None for p in trainer.parts.student.parameters())


def test_non_finite_teacher_logprobs_skip_the_step(base_config, monkeypatch):
    trainer = Trainer(config_from_dict(base_config), progress=False)
    before = {k: v.clone() for k, v in trainer.parts.student.state_dict().items()}
    monkeypatch.setattr(
        trainer.parts.teachers,
        "score",
        lambda batch, request=None: TeacherScores(
            torch.full_like(batch.sampled_logprobs_BT, float("nan"))
        ),
    )
    with pytest.warns(UserWarning, match="non-finite log-probs"):
        metrics = trainer.train_step(0)
    assert metrics["skipped"] == 1
    for name, value in trainer.parts.student.state_dict().items():
        assert torch.equal(value, before[name])


def test_a_student_with_nan_logits_has_its_step_skipped(base_config):
    trainer = Trainer(config_from_dict(base_config), progress=False)
    with torch.no_grad():
        trainer.parts.student.model.norm.weight[0] = float("nan")
    before = {k: v.clone() for k, v in trainer.parts.student.state_dict().items()}
    with pytest.warns(UserWarning, match="non-finite log-probs"):
        metrics = trainer.train_step(0)
    assert metrics["skipped"] == 1
    for name, value in trainer.parts.student.state_dict().items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0, equal_nan=True)


def test_lora_trains_only_adapters_and_saves_a_peft_adapter(base_config, model_dirs):
    base_config["student"]["lora_rank"] = 4
    base_config["training"]["learning_rate"] = 1e-2
    result = train(config_from_dict(base_config), progress=False)
    trainable = [n for n, p in result.student.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert (latest_model_dir(result.log_path) / "adapter_model.safetensors").exists()
    base = AutoModelForCausalLM.from_pretrained(model_dirs["student"])
    loaded = PeftModel.from_pretrained(base, latest_model_dir(result.log_path))
    ids = torch.tensor([[1, 5, 6, 7]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, result.student(ids).logits)
        assert not torch.allclose(
            loaded(ids).logits,
            AutoModelForCausalLM.from_pretrained(model_dirs["student"])(ids).logits,
        )


def test_topk_larger_than_the_vocabulary_is_refused(base_config):
    base_config["training"].update(objective={"name": "topk_forward_kl", "topk": 500})
    with pytest.raises(
        ConfigError,
        match=r"training\.objective\.topk: 500 is larger than the vocabulary \(103 tokens\)",
    ):
        Trainer(config_from_dict(base_config), progress=False)


@pytest.mark.parametrize("supported", [False, True])
def test_half_precision_without_cpu_support_is_warned_about_by_field(
    base_config, monkeypatch, supported
):
    """Without oneDNN's bfloat16 / float16 instructions each half-precision setting is named."""
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: supported)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", lambda: supported)
    base_config["student"].update(device="cpu", sampling_dtype="bfloat16")
    base_config["teacher"].update(device="cpu", dtype="float16")
    base_config["training"]["autocast"] = "bfloat16"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Trainer(config_from_dict(base_config), progress=False)
    slow = sorted(
        str(w.message).split(":")[0] for w in caught if "slower than float32" in str(w.message)
    )
    assert slow == (
        [] if supported else ["student.sampling_dtype", "teacher.dtype", "training.autocast"]
    )
    if not supported:
        assert any("no float16 matmul instructions" in str(w.message) for w in caught)


def test_missing_model_path_is_named(base_config, tmp_path):
    """When the config is read; and by the loader, for a path gone since."""
    from opd.models import load_causal_lm

    base_config["student"]["model"] = str(tmp_path / "no-such-model")
    with pytest.raises(ConfigError, match=r"student\.model: path '.*no-such-model' does not exist"):
        config_from_dict(base_config)
    with pytest.raises(
        ModelLoadError, match=r"student\.model: path '.*no-such-model' does not exist"
    ):
        load_causal_lm(
            str(tmp_path / "no-such-model"), "student.model", dtype="float32", device="cpu"
        )
    assert not (tmp_path / "run").exists()


def lowercasing_char_tokenizer():
    """The char tokenizer's entries with a lower-casing normalizer: the same vocabulary, other
    ids."""
    from tokenizers import normalizers

    tokenizer = build_char_tokenizer()
    tokenizer.backend_tokenizer.normalizer = normalizers.Lowercase()
    return tokenizer


@pytest.mark.parametrize(
    ("tokenizer", "message"),
    [
        (
            partial(build_char_tokenizer, alphabet="0123456789abc"),
            r"^teacher\.model: the teacher's tokenizer differs.*cross-tokenizer",
        ),
        (
            lowercasing_char_tokenizer,
            r"^teacher\.model: the teacher's tokenizer has the student's entries but splits "
            r"'The quick brown fox.*' otherwise .*normalizer or pre-tokenizer.*cross_tokenizer: "
            r"true",
        ),
    ],
    ids=["another-vocabulary", "same-entries-split-otherwise"],
)
def test_a_teacher_whose_tokenizer_reads_text_otherwise_is_refused(
    base_config, tmp_path, tokenizer, message
):
    """Another vocabulary, or the same entries with another normalizer (a probe text's ids
    differ): the teacher would score other tokens than the student wrote."""
    built = tokenizer()
    path = tmp_path / "other-teacher"
    tiny_llama(len(built)).save_pretrained(path)
    built.save_pretrained(path)
    base_config["teacher"]["model"] = str(path)
    with pytest.raises(ModelLoadError, match=message):
        Trainer(config_from_dict(base_config), progress=False)


def test_per_dataset_teachers_and_metrics(base_config, model_dirs, prompts_file):
    base_config["datasets"].append(
        {
            "name": "self",
            "source": str(prompts_file),
            "groups_per_batch": 1,
            "group_size": 2,
            "teacher": {"model": str(model_dirs["student"])},
        }
    )
    trainer = Trainer(config_from_dict(base_config), progress=False)
    assert trainer.parts.teachers.per_dataset[0] is not trainer.parts.teachers.per_dataset[1]
    metrics = trainer.train_step(0)
    assert abs(metrics["teacher_kl/self"]) < 1e-5  # scored by the student itself
    assert metrics["teacher_kl/rev"] > 0.1


def test_datasets_sharing_a_teacher_share_its_loaded_tokenizer_and_format(
    base_config, prompts_file, monkeypatch
):
    from opd.teachers import loading as teacher_loading
    from opd.teachers import panel as teacher_panel

    loads = []
    original = teacher_panel.load_tokenizer
    for module in (
        teacher_panel,
        teacher_loading,
    ):  # the format's tokenizer, the vocabulary check's
        monkeypatch.setattr(
            module,
            "load_tokenizer",
            lambda name, *a, **k: loads.append(name) or original(name, *a, **k),
        )
    base_config["teacher"]["chat_template"] = "tokenizer"
    second = dict(base_config["datasets"][0], name="again", source=str(prompts_file))
    base_config["datasets"].append(second)
    trainer = Trainer(config_from_dict(base_config), progress=False)
    (first, _), (second, _) = (
        trainer.parts.teachers.readings[0][0],
        trainer.parts.teachers.readings[1][0],
    )
    assert first.format is second.format is not None
    assert first.teacher is second.teacher
    # one load for the teacher's template format, one for the vocabulary check
    assert loads == [base_config["teacher"]["model"]] * 2


def test_show_examples_prints_colored_tokens(base_config, capsys):
    base_config["training"].update(show_examples=True, max_steps=1)
    train(config_from_dict(base_config), progress=False)
    out = capsys.readouterr().out
    assert "--- rev" in out and "\033[2m<|im_start|>" in out and "[KL>=1]" in out


@pytest.mark.parametrize("flag_first", [False, True])
def test_cli_train_with_overrides(base_config, tmp_path, flag_first):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(base_config))
    overrides = ["training.max_steps=1", f"log_path={tmp_path / 'cli-run'}"]
    argv = ["--no-progress", *overrides] if flag_first else [*overrides, "--no-progress"]
    assert main(["train", str(path), *argv]) == 0
    rows = [
        json.loads(line)
        for line in (tmp_path / "cli-run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert len(rows) == 1


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["train", "c.yaml", "--no-progress", "a.b=1", "--nope"], "--nope"),
        (["report", "runs/x", "a.b=1"], "a.b=1"),
    ],
)
def test_cli_refuses_what_it_does_not_know(argv, named, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.rstrip().endswith(f"error: unrecognized arguments: {named}")


def test_cli_reports_config_errors_without_writing(base_config, tmp_path, capsys):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(base_config))
    assert main(["train", str(path), "training.max_stepz=1"]) == 2
    assert (
        "training.max_stepz: unknown key; did you mean 'training.max_steps'"
        in capsys.readouterr().err
    )
    assert not (tmp_path / "run").exists()


def test_the_progress_bar_fits_80_columns_with_its_metrics():
    from tqdm import tqdm

    from opd.runs.display import PROGRESS_FORMAT, progress_postfix

    metrics = {
        "teacher_kl": 0.0512345,
        "entropy": 0.23456,
        "kl_sample_train": 1e-7,
        "completion_len_mean": 4.5217,
    }
    assert progress_postfix(metrics) == "kl 0.0512 H 0.235 len 4.52"
    line = tqdm.format_meter(
        n=1234,
        total=5000,
        elapsed=3725.0,
        prefix="opd",
        bar_format=PROGRESS_FORMAT,
        postfix=progress_postfix(metrics),
    )
    assert len(line) <= 80 and line.endswith("kl 0.0512 H 0.235 len 4.52]"), line
