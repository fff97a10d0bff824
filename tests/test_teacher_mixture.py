"""Teachers mixed token by token (``teacher.mixture``): the mixture's log-prob and top-k by hand
on a 5-token vocabulary, a real run's teacher answer against naive forwards of each teacher, a
one-teacher mixture bit for bit the plain teacher, a member behind ``opd serve`` equal to the same
member in the process, and every misconfiguration refused naming its setting."""

from __future__ import annotations

import math

import pytest
import torch

from opd.config import ConfigError, config_from_dict
from opd.teachers.mixture import mixed_logprobs, mixed_topk
from opd.trainer.loop import Trainer, train
from tests.servers import free_port, start_opd_serve

CONTEXT = "The answer is {answer}."

# two teachers on 5 tokens, mixed 0.4 / 0.6
Q1 = [0.5, 0.2, 0.1, 0.1, 0.1]
Q2 = [0.1, 0.6, 0.2, 0.05, 0.05]
W = [0.4, 0.6]


def test_the_mixture_log_prob_of_a_token_is_the_weighted_sum_of_the_teachers_probabilities():
    logprobs_MN = torch.tensor(
        [[math.log(Q1[t]) for t in range(5)], [math.log(Q2[t]) for t in range(5)]]
    )
    mixed = mixed_logprobs(logprobs_MN, torch.tensor(W))
    by_hand = [0.4 * 0.5 + 0.6 * 0.1, 0.4 * 0.2 + 0.6 * 0.6, 0.4 * 0.1 + 0.6 * 0.2]
    by_hand += [0.4 * 0.1 + 0.6 * 0.05] * 2
    assert mixed.tolist() == pytest.approx([math.log(p) for p in by_hand], abs=1e-6)


def test_the_mixture_top_k_reads_each_teacher_where_it_sent_the_token_and_its_tail_elsewhere():
    """Top-2 of each: teacher 1 sends tokens 0, 1 (tail 0.3, a third of it per other token),
    teacher 2 tokens 1, 2 (tail 0.2). Token 0: 0.4 * 0.5 + 0.6 * 0.2 / 3 = 0.24; token 1:
    0.4 * 0.2 + 0.6 * 0.6 = 0.44; token 2: 0.4 * 0.3 / 3 + 0.6 * 0.2 = 0.16."""
    ids = torch.tensor([[[0, 1]], [[1, 2]]])
    logprobs = torch.tensor([[[math.log(0.5), math.log(0.2)]], [[math.log(0.6), math.log(0.2)]]])
    top_ids, top_logprobs = mixed_topk(ids, logprobs, torch.tensor(W), k=2, vocab_size=5)
    assert top_ids.tolist() == [[1, 0]]
    assert top_logprobs.exp().tolist()[0] == pytest.approx([0.44, 0.24], abs=1e-6)
    # the bound: off the true mixture by at most w_i min(r_i, p_i(k)) for each teacher that did not
    # send it
    true = [W[0] * Q1[t] + W[1] * Q2[t] for t in range(5)]
    bound = {0: W[1] * min(0.2, 0.2), 1: 0.0, 2: W[0] * min(0.3, 0.2)}
    for token, p in zip(top_ids[0].tolist(), top_logprobs.exp()[0].tolist(), strict=True):
        assert abs(p - true[token]) <= bound[token] + 1e-6  # float32 log-probs
    _, three = mixed_topk(ids, logprobs, torch.tensor(W), k=3, vocab_size=5)
    assert three.exp().sum() <= 1.0  # the objective's tail bucket stays a probability


def mixture(config: dict, weights=(0.3, 0.7)) -> dict:
    """The tiny teacher and the student shown the answer, mixed."""
    return {
        "mixture": [
            dict(config["teacher"], weight=weights[0]),
            {"model": "student", "context": CONTEXT, "weight": weights[1]},
        ]
    }


def naive_logprobs(model, renderer, messages, completion: list[int]) -> torch.Tensor:
    """Log-probs of every token after the prompt, in one forward of ``model`` over the hand
    render."""
    shown = renderer.prompt_ids(messages)
    with torch.no_grad():
        logits = model(torch.tensor([shown + completion])).logits[0].float()
    return torch.log_softmax(logits, -1)[len(shown) - 1 : -1]


def test_each_sampled_token_is_scored_by_the_mixture_of_naive_forwards_and_each_teacher_has_its_kl(
    answered,
):
    answered["teacher"] = mixture(answered)
    trainer = Trainer(config_from_dict(answered), progress=False)
    batch = trainer.collect(0)
    renderer = trainer.parts.renderer
    teacher = trainer.parts.teachers.readings[0][0][0].teacher.model
    student = trainer.parts.teachers.readings[0][1][0].teacher.model
    gaps = [[], []]
    rollouts = batch.rollouts
    for row in range(rollouts.input_ids_BT.shape[0]):
        record, length = rollouts.prompt_records[row], rollouts.prompt_lengths[row]
        completion = rollouts.sequences[row][length:]
        shown = ({"role": "system", "content": f"The answer is {record.answer}."}, *record.messages)
        each = [
            naive_logprobs(teacher, renderer, record.messages, completion),
            naive_logprobs(student, renderer, shown, completion),
        ]
        picked = [lp.gather(-1, torch.tensor(completion)[:, None])[:, 0] for lp in each]
        by_hand = torch.logsumexp(
            torch.stack([math.log(0.3) + picked[0], math.log(0.7) + picked[1]]), 0
        )
        mask = rollouts.mask_BT[row].bool()
        scored = int(mask.sum())
        assert batch.teacher.logprobs_BT[row][mask].tolist() == pytest.approx(
            by_hand[:scored].tolist(), abs=1e-5
        )
        for number in (0, 1):
            assert batch.teacher.member_logprobs_MBT[number, row][mask].tolist() == pytest.approx(
                picked[number][:scored].tolist(), abs=1e-5
            )
            gaps[number] += (
                rollouts.sampled_logprobs_BT[row][mask] - picked[number][:scored]
            ).tolist()
    metrics = trainer.learner.kl_metrics(batch)
    for number in (0, 1):
        assert metrics[f"teacher_kl/mixture_{number}"] == pytest.approx(
            sum(gaps[number]) / len(gaps[number]), abs=1e-5
        )


def test_the_mixture_top_k_of_a_run_is_the_union_of_each_teachers_top_k(answered):
    answered["teacher"] = mixture(answered, (0.5, 0.5))
    answered["training"]["objective"] = {"name": "topk_forward_kl", "topk": 4}
    trainer = Trainer(config_from_dict(answered), progress=False)
    batch = trainer.collect(0)
    renderer, rollouts = trainer.parts.renderer, batch.rollouts
    teacher = trainer.parts.teachers.readings[0][0][0].teacher.model
    student = trainer.parts.teachers.readings[0][1][0].teacher.model
    for row in range(rollouts.input_ids_BT.shape[0]):
        record, length = rollouts.prompt_records[row], rollouts.prompt_lengths[row]
        completion = rollouts.sequences[row][length:]
        shown = ({"role": "system", "content": f"The answer is {record.answer}."}, *record.messages)
        tops = [
            naive_logprobs(teacher, renderer, record.messages, completion).topk(4, -1),
            naive_logprobs(student, renderer, shown, completion).topk(4, -1),
        ]
        ids, logprobs = mixed_topk(
            torch.stack([t.indices for t in tops]),
            torch.stack([t.values for t in tops]),
            torch.tensor([0.5, 0.5]),
            4,
            len(trainer.parts.tokenizer),
        )
        mask = rollouts.mask_BT[row].bool()
        scored = int(mask.sum())
        assert batch.teacher.topk_ids_BTK[row][mask].tolist() == ids[:scored].tolist()
        assert batch.teacher.topk_logprobs_BTK[row][mask] == pytest.approx(
            logprobs[:scored], abs=1e-5
        )


def full_distributions(batch, row: int) -> torch.Tensor:
    """The teacher distribution (log) at each scored position of ``row``, as the objective reads it:
    ``logsumexp_i(log w_i + log softmax(head_i(hidden_i)))`` over the heads the batch carries."""
    mask = batch.rollouts.mask_BT[row : row + 1].bool()
    heads = batch.teacher.select([row]).rows(mask).heads
    parts = []
    for head in heads:
        log = torch.log_softmax(head.head(head.hidden_ND).float(), -1)
        weight = torch.ones(log.shape[0]) if head.weight_N is None else head.weight_N
        parts.append(log + weight.log()[:, None])
    return torch.logsumexp(torch.stack(parts), 0)


def test_jsd_reads_each_datasets_own_teacher_and_a_mixture_of_local_teachers(answered):
    """Two datasets in one batch, each with its own teacher: each row's full distribution is its
    own teacher's (it was the first dataset's teacher's lm head for every row before); and a
    mixture of two local teachers (one the student shown the answer) under jsd: each position's
    distribution is ``log(0.3 softmax(teacher) + 0.7 softmax(student shown the answer))`` of naive
    forwards, and a step learns from it."""
    answered["training"]["objective"] = {"name": "jsd", "beta": 0.0}
    answered["datasets"].append(
        dict(answered["datasets"][0], name="own", teacher={"model": "student"})
    )
    trainer = Trainer(config_from_dict(answered), progress=False)
    batch = trainer.collect(0)
    rollouts = batch.rollouts
    assert sorted(set(rollouts.dataset_index_B.tolist())) == [0, 1]
    for row in range(rollouts.input_ids_BT.shape[0]):
        dataset = int(rollouts.dataset_index_B[row])
        model = trainer.parts.teachers.readings[dataset][0][0].teacher.model
        record, length = rollouts.prompt_records[row], rollouts.prompt_lengths[row]
        naive = naive_logprobs(
            model, trainer.parts.renderer, record.messages, rollouts.sequences[row][length:]
        )
        got = full_distributions(batch, row)
        torch.testing.assert_close(got, naive[: got.shape[0]], atol=1e-5, rtol=0)
    assert math.isfinite(trainer.learn(batch)["loss"])

    answered["datasets"].pop()
    answered["teacher"] = mixture(answered)
    trainer = Trainer(config_from_dict(answered), progress=False)
    batch = trainer.collect(0)
    rollouts = batch.rollouts
    teacher = trainer.parts.teachers.readings[0][0][0].teacher.model
    student = trainer.parts.teachers.readings[0][1][0].teacher.model
    for row in range(rollouts.input_ids_BT.shape[0]):
        record, length = rollouts.prompt_records[row], rollouts.prompt_lengths[row]
        completion = rollouts.sequences[row][length:]
        shown = ({"role": "system", "content": f"The answer is {record.answer}."}, *record.messages)
        mixed = (
            0.3 * naive_logprobs(teacher, trainer.parts.renderer, record.messages, completion).exp()
            + 0.7 * naive_logprobs(student, trainer.parts.renderer, shown, completion).exp()
        ).log()
        got = full_distributions(batch, row)
        torch.testing.assert_close(got, mixed[: got.shape[0]], atol=1e-5, rtol=0)
    metrics = trainer.learn(batch)
    assert math.isfinite(metrics["loss"]) and "teacher_kl/mixture_1" in metrics


def without_times(rows: list[dict]) -> list[dict]:
    return [
        {k: v for k, v in row.items() if not k.startswith(("time/", "throughput/", "memory/"))}
        for row in rows
    ]


def test_a_one_teacher_mixture_is_the_plain_teacher_bit_for_bit(answered):
    plain = train(
        config_from_dict(answered | {"log_path": answered["log_path"] + "-plain"}), progress=False
    )
    answered["teacher"] = {"mixture": [dict(answered["teacher"], weight=1.0)]}
    one = train(config_from_dict(answered), progress=False)
    assert without_times(one.metrics) == without_times(plain.metrics)


def test_a_mixture_member_behind_opd_serve_gives_the_run_the_local_member_gives(
    answered, model_dirs, tmp_path
):
    answered["teacher"] = mixture(answered)
    local = train(config_from_dict(answered), progress=False).metrics
    port = free_port()
    server = start_opd_serve(model_dirs["teacher"], port, "--max-logprobs", "5")
    try:
        remote = dict(answered, log_path=str(tmp_path / "remote"))
        remote["teacher"] = {
            "mixture": [
                {
                    "model": "teacher",
                    "backend": "openai",
                    "base_url": f"http://127.0.0.1:{port}/v1",
                    "tokenizer": str(model_dirs["teacher"]),
                    "weight": 0.3,
                },
                answered["teacher"]["mixture"][1],
            ]
        }
        served = train(config_from_dict(remote), progress=False).metrics
    finally:
        server.kill()
        server.wait()
    for a, b in zip(local, served, strict=True):
        for key in ("teacher_kl", "teacher_kl/mixture_0", "teacher_kl/mixture_1", "loss"):
            assert a[key] == pytest.approx(b[key], abs=1e-5)


@pytest.mark.parametrize(
    ("teacher", "training", "message"),
    [
        (
            {"mixture": [{"model": "T", "weight": 0.5}, {"model": "T", "weight": 0.4}]},
            {},
            r"^teacher\.mixture: the weights must sum to 1, got 0\.9 \(0\.5, 0\.4\)$",
        ),
        (
            {"mixture": [{"model": "T", "weight": 1.0}], "dtype": "float32"},
            {},
            r"^teacher\.dtype: is set on each member \(mixture\[i\]\.dtype\), not beside mixture$",
        ),
        (
            {"mixture": [{"mixture": [{"model": "T", "weight": 1.0}], "weight": 1.0}]},
            {},
            r"^teacher\.mixture\[0\]\.mixture: mixtures do not nest",
        ),
        ({"mixture": []}, {}, r"^teacher\.mixture: is empty"),
        (
            {"mixture": [{"model": "T"}, {"model": "T", "weight": 1.0}]},
            {},
            r"^teacher\.mixture\[0\]\.weight: required: its share of the mixture, in \(0, 1\]$",
        ),
        ({"context": "x"}, {}, r"^teacher\.model: required: .*or give mixture"),
        (
            {
                "mixture": [
                    {
                        "model": "T",
                        "backend": "openai",
                        "base_url": "http://127.0.0.1:1/v1",
                        "weight": 0.5,
                    },
                    {"model": "student", "weight": 0.5},
                ]
            },
            {"objective": "jsd"},
            r"^training\.objective: 'jsd' needs the teacher's full distribution, which "
            r"teacher\.mixture\[0\] "
            r"\(backend 'openai'\) does not send",
        ),
        (
            None,
            {"data_source": "teacher", "objective": "nll"},
            r"^teacher\.mixture: training\.data_source 'teacher' has the teacher write",
        ),
    ],
)
def test_a_bad_mixture_is_refused_naming_the_setting(answered, teacher, training, message):
    answered["teacher"] = teacher or mixture(answered)
    answered["training"] |= training
    with pytest.raises(ConfigError, match=message):
        config_from_dict(answered)


def test_the_dry_run_shows_a_prompt_as_the_student_and_each_teacher_read_it(
    answered, tmp_path, capsys
):
    import yaml

    from opd.cli import main

    answered["teacher"] = mixture(answered)
    path = tmp_path / "mixed.yaml"
    path.write_text(yaml.safe_dump(answered))
    assert main(["train", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    plain = "<|im_start|>user\nreverse abc<|im_end|>\n<|im_start|>assistant\n"
    shown = "<|im_start|>system\nThe answer is cba.<|im_end|>\n" + plain
    boxed = ["  | " + line for line in plain.split("\n")]
    assert (
        "\n".join(["prompt         rev, its first prompt, as the student reads it:", *boxed]) in out
    )
    assert "teacher mixture[0] reads it as the student does" in out
    view = ["teacher mixture[1] reads it as:", *("  | " + line for line in shown.split("\n"))]
    assert "\n".join(view) in out
    assert not (tmp_path / "run").exists()


def test_one_teacher_model_with_thinking_on_and_off_is_read_in_two_formats(answered):
    """The same model and template with other template variables: a format each (they were once
    shared, the second reading the first one's rendering)."""
    template = "{% if think %}<think>{% endif %}{{ messages[-1]['content'] }}: "
    on = dict(
        answered["teacher"],
        chat_template=template,
        chat_template_kwargs={"think": True},
        weight=0.5,
    )
    off = dict(on, chat_template_kwargs={"think": False})
    answered["teacher"] = {"mixture": [on, off]}
    trainer = Trainer(config_from_dict(answered), progress=False)
    (first, _), (second, _) = trainer.parts.teachers.readings[0]
    assert first.teacher is second.teacher  # one model loaded
    assert first.format.renderer.render_text([{"role": "user", "content": "q"}]) == "<think>q: "
    assert second.format.renderer.render_text([{"role": "user", "content": "q"}]) == "q: "
