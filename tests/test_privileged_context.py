"""Privileged context: the teacher reads a text written from each prompt's fields that the student
never sees (``teacher.context``), and ``teacher.model: student`` makes the student's own starting
weights that teacher. Checked against hand-rendered conversations, a naive forward of the tiny
teacher, the identity teacher == student at step 0, and a real ``opd serve`` process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from opd.config import ConfigError, config_from_dict
from opd.data.prompts import Prompt
from opd.runs.metrics import read_jsonl
from opd.teachers.context import PrivilegedContext
from opd.trainer.loop import Trainer, train
from tests.servers import free_port, start_opd_serve, through_server
from tests.test_distributed import models  # noqa: F401 (the tiny models of the torchrun tests)


def assert_scored_as_shown(batch, row: int, renderer, model, messages) -> None:
    """Row ``row``'s teacher log-probs equal a naive forward of ``model`` over ``messages`` rendered
    by hand, followed by the row's completion."""
    ids, length = batch.rollouts.sequences[row], batch.rollouts.prompt_lengths[row]
    shown, completion = renderer.prompt_ids(messages), ids[length:]
    with torch.no_grad():
        logits = model(torch.tensor([shown + completion])).logits[0].float()
    expected = torch.log_softmax(logits, -1)[len(shown) - 1 : -1].gather(
        -1, torch.tensor(completion)[:, None]
    )
    mask = batch.rollouts.mask_BT[row].bool()
    assert batch.teacher.logprobs_BT[row][mask] == pytest.approx(
        expected[: int(mask.sum()), 0].tolist(), abs=1e-5
    )


def test_the_context_goes_where_its_role_says_and_the_prompt_is_otherwise_untouched():
    prompt = Prompt(
        ({"role": "user", "content": "reverse abc"},), answer="cba", metadata={"k": {"v": 3}}
    )
    context = PrivilegedContext("Answer: {answer} ({metadata.k.v}) {{literal}}")
    assert context.messages(prompt) == (
        {"role": "system", "content": "Answer: cba (3) {literal}"},
        {"role": "user", "content": "reverse abc"},
    )
    with_system = Prompt(
        ({"role": "system", "content": "Be brief."}, *prompt.messages),
        answer="cba",
        metadata={"k": {"v": 3}},
    )
    assert context.messages(with_system)[0] == {
        "role": "system",
        "content": "Be brief.\n\nAnswer: cba (3) {literal}",
    }
    user = PrivilegedContext("Answer: {answer}", "user")
    assert user.messages(with_system) == (
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Answer: cba\n\nreverse abc"},
    )
    assert prompt.messages == ({"role": "user", "content": "reverse abc"},)  # not changed in place


def test_the_teacher_scores_the_student_tokens_after_the_context_it_alone_reads(answered):
    """Each completion token's teacher log-prob equals a naive forward of the teacher over the
    conversation rendered by hand with the context; the student's own rows hold no context."""
    answered["teacher"]["context"] = "The answer is {answer}."
    trainer = Trainer(config_from_dict(answered), progress=False)
    batch = trainer.collect(0)
    renderer, model = trainer.parts.renderer, trainer.parts.teachers.per_dataset[0].model
    for row in range(batch.rollouts.input_ids_BT.shape[0]):
        record = batch.rollouts.prompt_records[row]
        length = batch.rollouts.prompt_lengths[row]
        ids = batch.rollouts.sequences[row]
        assert ids[:length] == renderer.prompt_ids(
            record.messages
        )  # the student's prompt: no context
        assert "The answer is" not in trainer.parts.tokenizer.decode(ids)
        shown = ({"role": "system", "content": f"The answer is {record.answer}."}, *record.messages)
        assert_scored_as_shown(batch, row, renderer, model, shown)


def test_the_student_as_its_own_teacher_agrees_with_itself_until_it_is_shown_the_answer(answered):
    """``teacher.model: student`` loads the student's checkpoint: without a context the teacher KL
    of step 0 (no update yet) is exactly 0; with the answer in its context it is not."""
    answered["teacher"] = {"model": "student"}
    plain = train(
        config_from_dict(answered | {"log_path": answered["log_path"] + "-plain"}), progress=False
    )
    assert plain.metrics[0]["teacher_kl"] == pytest.approx(0.0, abs=1e-6)
    answered["teacher"]["context"] = "The answer is {answer}."
    shown = train(config_from_dict(answered), progress=False)
    assert shown.metrics[0]["teacher_kl"] > 1e-3


def test_a_field_the_prompts_lack_is_named_with_the_fields_they_have_before_any_step(
    answered, tmp_path
):
    answered["teacher"]["context"] = "The answer is {metadata.solution}."
    with pytest.raises(
        ConfigError,
        match=r"^teacher\.context: \{metadata\.solution\} is not a field of prompt 0 of "
        r".*answered\.jsonl; "
        r"its fields: answer, metadata\.hint\.first$",
    ):
        Trainer(config_from_dict(answered), progress=False)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    ("context", "message"),
    [
        ("The answer is {solution}.", r"\{solution\} is not a prompt field: use \{answer\}"),
        ("The answer is {answer", r"expected '\}' before end of string"),
        ("{answer:>5}", r"with no format spec"),
        ("  ", r"is empty"),
    ],
)
def test_a_bad_template_is_refused_naming_the_setting(answered, context, message):
    answered["teacher"]["context"] = context
    with pytest.raises(ConfigError, match=rf"teacher\.context: .*{message}"):
        config_from_dict(answered)


def test_a_served_teacher_shown_the_context_reproduces_the_local_run(
    answered, model_dirs, tmp_path
):
    """The context only makes the teacher's prompt longer: through ``opd serve`` the run's metrics
    equal the local teacher's."""
    answered["teacher"]["context"] = "The answer is {answer}."
    local = train(config_from_dict(answered), progress=False).metrics
    port = free_port()
    server = start_opd_serve(model_dirs["teacher"], port, "--max-logprobs", "5")
    try:
        remote_config = through_server(answered, port, tmp_path / "remote")
        remote_config["teacher"]["context"] = "The answer is {answer}."
        remote = train(config_from_dict(remote_config), progress=False).metrics
    finally:
        server.kill()
        server.wait()
    for a, b in zip(local, remote, strict=True):
        assert a["teacher_kl"] == pytest.approx(b["teacher_kl"], abs=1e-5)
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
    assert read_jsonl(tmp_path / "remote" / "metrics.jsonl")


def test_datasets_sharing_a_teacher_model_are_each_read_with_their_own_context(answered):
    """One model loaded once, shown the answer on one dataset and not on the other: each row is
    scored as its own dataset's teacher reads it (rows were once grouped by the model alone)."""
    plain = dict(answered["datasets"][0], name="plain")
    shown = dict(
        answered["datasets"][0],
        name="shown",
        teacher=dict(answered["teacher"], context="It is {answer}."),
    )
    answered["datasets"] = [plain, shown]
    trainer = Trainer(config_from_dict(answered), progress=False)
    assert trainer.parts.teachers.per_dataset[0] is trainer.parts.teachers.per_dataset[1]
    batch = trainer.collect(0)
    renderer, model = trainer.parts.renderer, trainer.parts.teachers.per_dataset[0].model
    datasets = batch.rollouts.dataset_index_B.tolist()
    assert set(datasets) == {0, 1}
    for row, dataset in enumerate(datasets):
        record = batch.rollouts.prompt_records[row]
        messages = (
            record.messages
            if dataset == 0
            else ({"role": "system", "content": f"It is {record.answer}."}, *record.messages)
        )
        assert_scored_as_shown(batch, row, renderer, model, messages)


def test_two_processes_shown_the_context_make_the_update_one_process_makes(models, tmp_path):  # noqa: F811
    """The student as its own teacher, shown the answer, mixed with the tiny teacher
    (``teacher.mixture``), under FSDP on two processes (torchrun, gloo) against one process: the
    same metrics row for row, the KL to each teacher of the mixture included."""
    from tests.test_distributed import (
        assert_same_metrics,
        one_process,
        run_config,
        two_processes,
        write,
    )

    def config(name: str) -> Path:
        data = run_config(models, tmp_path / name)
        shown = {"model": "student", "context": "The answer is {answer}.", "weight": 0.6}
        data["teacher"] = {"mixture": [dict(data["teacher"], weight=0.4), shown]}
        return write(data, tmp_path / f"{name}.yaml")

    one_process(config("one"))
    two_processes(config("two"), "training.parallel=fsdp")
    reference = read_jsonl(tmp_path / "one" / "metrics.jsonl")
    assert (
        reference[0]["teacher_kl/mixture_1"] > 1e-3
    )  # the context moves the student's own judgement
    assert_same_metrics(read_jsonl(tmp_path / "two" / "metrics.jsonl"), reference)


def test_sigkill_then_resume_with_a_context_matches_an_uninterrupted_run(answered, tmp_path):
    """The student shown the answer, mixed with the tiny teacher (``teacher.mixture``)."""
    from tests.test_resume import assert_same_rows, killed_and_resumed, run_cli, write_config

    shown = {"model": "student", "context": "The answer is {answer}.", "weight": 0.6}
    answered["teacher"] = {"mixture": [dict(answered["teacher"], weight=0.4), shown]}
    run_cli(write_config(answered, tmp_path, "reference"))
    reference = read_jsonl(tmp_path / "reference" / "metrics.jsonl")
    assert_same_rows(killed_and_resumed(answered, tmp_path), reference)


def test_a_lora_student_is_its_own_teacher_with_its_adapters_off_and_no_second_copy(answered):
    """``model: student`` with a LoRA student scores with the student's own model, adapters off:
    no second copy, the trainer's train/eval mode untouched, and after three updates (adapters far
    from zero) the same run as a frozen copy of the starting weights gives (the teacher's dtype
    set explicitly, which asks for a copy)."""
    answered["student"]["lora_rank"] = 4
    answered["training"] |= {"max_steps": 3, "learning_rate": 0.05}
    answered["teacher"] = {"model": "student", "context": "The answer is {answer}."}
    trainer = Trainer(config_from_dict(answered), progress=False)
    assert trainer.parts.teachers.per_dataset[0].model is trainer.parts.policy.model
    trainer.parts.policy.model.train()
    trainer.collect(0)
    assert trainer.parts.policy.model.training
    shared = train(
        config_from_dict(answered | {"log_path": answered["log_path"] + "-shared"}), progress=False
    )
    copied_config = answered | {"log_path": answered["log_path"] + "-copy"}
    copied_config["teacher"] = dict(answered["teacher"], dtype="float32")
    copy_trainer = Trainer(config_from_dict(copied_config), progress=False)
    assert copy_trainer.parts.teachers.per_dataset[0].model is not copy_trainer.parts.policy.model
    copied = train(config_from_dict(copied_config), progress=False)
    assert shared.metrics[-1]["step"] == 2
    for a, b in zip(shared.metrics, copied.metrics, strict=True):
        for key in ("teacher_kl", "loss", "grad_norm"):
            assert a[key] == pytest.approx(b[key], abs=1e-5), (a["step"], key)
    assert shared.metrics[-1]["teacher_kl"] != pytest.approx(
        shared.metrics[0]["teacher_kl"], abs=1e-4
    )


@pytest.mark.parametrize(
    "overrides",
    [
        ["training.max_staleness=1"],
        ["training.data_source=mixed", "training.off_policy_objective=nll"],
        ["student.lora_rank=0"],
    ],
)
def test_where_the_students_model_is_busy_or_trained_whole_the_teacher_is_a_frozen_copy(
    answered, overrides
):
    from opd.trainer.plan import describe_plan

    answered["student"]["lora_rank"] = 4
    answered["teacher"] = {"model": "student"}
    config = config_from_dict(answered, overrides)
    copy = "the student with its LoRA adapters off: no second copy"
    assert copy not in describe_plan(config, 1)
    assert copy in describe_plan(config_from_dict(answered), 1)
    trainer = Trainer(config, progress=False)
    assert trainer.parts.teachers.per_dataset[0].model is not trainer.parts.policy.model


def test_a_teacher_shown_the_context_writes_after_it_when_it_writes_the_completions(answered):
    """``data_source: teacher``: the teacher samples from the conversation rendered with the
    context (by hand here), and the student's rows keep the plain prompt."""
    answered["teacher"]["context"] = "The answer is {answer}."
    answered["training"] |= {"data_source": "teacher", "objective": "nll"}
    trainer = Trainer(config_from_dict(answered), progress=False)
    (writer,) = {id(w): w for w in trainer.parts.teacher_writers}.values()
    asked = []
    sample = writer.sample
    writer.sample = lambda prompts, *rest: asked.extend(prompts) or sample(prompts, *rest)
    batch = trainer.collect(0)
    rollouts = batch.rollouts
    assert len(asked) == rollouts.input_ids_BT.shape[0]
    for row, prompt_ids in enumerate(asked):
        record = rollouts.prompt_records[row]
        shown = ({"role": "system", "content": f"The answer is {record.answer}."}, *record.messages)
        assert prompt_ids == trainer.parts.renderer.prompt_ids(shown)
        length = rollouts.prompt_lengths[row]
        assert rollouts.sequences[row][:length] == trainer.parts.renderer.prompt_ids(
            record.messages
        )


def test_a_teacher_shown_a_context_renders_with_the_students_template_and_its_variables(answered):
    """No template of its own: the student's, with the student's template variables (thinking
    mode), plus the context; what ``--dry-run`` shows is what the teacher scores."""
    from opd.assemble.teachers import teacher_views

    template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if think "
        "%}<think>{% endif %}assistant:"
    )
    answered["student"] |= {"chat_template": template, "chat_template_kwargs": {"think": True}}
    answered["teacher"]["context"] = "The answer is {answer}."
    config = config_from_dict(answered)
    views = teacher_views(config)
    assert views[views.index("teacher        reads it as:") + 1 :] == [
        "  | system: The answer is cba.",
        "  | user: reverse abc",
        "  | <think>assistant:",
    ]
    trainer = Trainer(config, progress=False)
    batch = trainer.collect(0)
    record = batch.rollouts.prompt_records[0]
    shown = ({"role": "system", "content": f"The answer is {record.answer}."}, *record.messages)
    assert trainer.parts.renderer.render_text(shown).endswith("<think>assistant:")
    assert_scored_as_shown(
        batch, 0, trainer.parts.renderer, trainer.parts.teachers.per_dataset[0].model, shown
    )
