"""Teachers reading multi-turn episodes: a teacher with another tokenizer reads each student turn
and none of the environment's, and a teacher behind ``opd serve`` scores a multi-turn run as the
same teacher in process does."""

from __future__ import annotations

import pytest

from opd.config import config_from_dict
from opd.data.render import ChatRenderer
from opd.data.sequences import Trajectory
from opd.teachers.alignment import TeacherFormat
from opd.trainer.loop import train
from tests.conftest import quick_to_stop, tiny_llama
from tests.servers import free_port, start_opd_serve, through_server
from tests.test_alignment import bpe_tokenizer


def test_a_cross_tokenizer_teacher_reads_each_turn_and_none_of_the_replies(char_tokenizer):
    """The teacher's ids are its own rendering of the whole conversation; each student turn is one
    piece, re-tokenized from the turn's text; without its likely tokens each turn's teacher
    log-probs are shared out over that turn's student tokens, their total kept turn by turn."""
    teacher_tokenizer = bpe_tokenizer()
    fmt = TeacherFormat(ChatRenderer(teacher_tokenizer), char_tokenizer, [2], cross_tokenizer=True)
    student = ChatRenderer(char_tokenizer)
    messages = ({"role": "user", "content": "reverse abc"},)
    reply = [{"role": "user", "content": "its a test"}]
    turn1 = char_tokenizer("abc", add_special_tokens=False)["input_ids"] + [2]
    between = student.reply_ids(list(messages), turn1, reply)
    turn2 = char_tokenizer("cba", add_special_tokens=False)["input_ids"] + [2]
    second = len(turn1) + len(between)
    trajectory = Trajectory(((0, len(turn1)), (second, second + len(turn2))), (tuple(reply),))
    built = fmt.build(messages, turn1 + between + turn2, trajectory)

    conversation = [
        *messages,
        {"role": "assistant", "content": "abc"},
        *reply,
        {"role": "assistant", "content": "cba"},
    ]
    rendered = teacher_tokenizer.apply_chat_template(conversation, tokenize=False)
    assert teacher_tokenizer.decode(built.token_ids) == rendered.removesuffix("\n")
    assert [piece.text for piece in built.turns] == ["abc", "cba"]
    scored = [t for t, m in zip(built.token_ids, built.score_mask, strict=True) if m]
    assert teacher_tokenizer.decode(scored) == "abc<|im_end|>cba<|im_end|>"
    for piece, turn in zip(built.turns, (turn1, turn2), strict=True):
        teacher = [-0.25 * (i + 1) for i in range(piece.length)]
        view = fmt.student_view(built, piece, teacher, [-0.1] * len(turn))
        assert len(view) == len(turn)
        assert sum(view) == pytest.approx(sum(teacher))


def quick_model(directory, tokenizer, seed: int):
    """A tiny model that ends most turns within a few tokens, saved with ``tokenizer``."""
    quick_to_stop(tiny_llama(len(tokenizer), seed=seed)).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def as_episodes(config: dict) -> None:
    """The config's dataset played as ``retry`` episodes of at most 2 turns."""
    config["datasets"][0] |= {
        "num_prompts": 6,
        "env": {"name": "retry", "max_turns": 2, "max_episode_tokens": 80},
    }


def test_a_multi_turn_run_through_opd_serve_reproduces_the_local_run(
    base_config, model_dirs, tmp_path, char_tokenizer
):
    base_config["student"]["model"] = str(
        quick_model(tmp_path / "quick_student", char_tokenizer, seed=1)
    )
    as_episodes(base_config)
    local = train(config_from_dict(base_config), progress=False)
    port = free_port()
    server = start_opd_serve(model_dirs["teacher"], port)
    try:
        remote_config = through_server(base_config, port, tmp_path / "remote")
        remote = train(config_from_dict(remote_config), progress=False)
    finally:
        server.kill()
        server.wait()
    assert max(row["episode/turns"] for row in local.metrics) > 1
    for a, b in zip(local.metrics, remote.metrics, strict=True):
        for key in ("teacher_kl", "teacher_kl/turn_1", "loss", "grad_norm", "episode/len"):
            assert a[key] == pytest.approx(b[key], abs=1e-5), key
        if "teacher_kl/turn_2" in a:
            assert a["teacher_kl/turn_2"] == pytest.approx(b["teacher_kl/turn_2"], abs=1e-5)


def test_a_served_teacher_plays_the_same_episodes_as_in_process(
    base_config, tmp_path, char_tokenizer
):
    """``mixed`` from the teacher's episodes (lmbda 0): the teacher behind ``opd serve`` plays each
    turn on its server, and the run's episodes and figures are those of the teacher in process."""
    quick = quick_model(tmp_path / "quick_teacher", char_tokenizer, seed=2)
    base_config["teacher"]["model"] = str(quick)
    as_episodes(base_config)
    base_config["training"] |= {
        "objective": {"name": "topk_forward_kl", "topk": 5},
        "data_source": "mixed",
        "lmbda": 0.0,
    }
    local = train(config_from_dict(base_config), progress=False)
    port = free_port()
    server = start_opd_serve(quick, port)
    try:
        remote = train(
            config_from_dict(through_server(base_config, port, tmp_path / "remote")), progress=False
        )
    finally:
        server.kill()
        server.wait()
    steps = [row for row in local.metrics if "episode/turns" in row]
    assert steps and all(row["on_policy"] == 0 for row in steps)
    assert max(row["episode/turns"] for row in steps) > 1
    for a, b in zip(local.metrics, remote.metrics, strict=True):
        for key in ("loss", "grad_norm", "episode/len", "episode/turns", "num_tokens"):
            if key in a:
                assert a[key] == pytest.approx(b[key], abs=1e-5), key
