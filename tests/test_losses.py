"""The torchrl-style distillation loss: the seed's example, reductions, errors, chat masks."""

import pytest
import torch

from opd.logprobs import sequence_logprobs
from opd.losses import (
    ChatDistillationLoss,
    distillation_loss,
    k3_kl_token_estimate,
    teacher_chat_logprobs,
    tokenize_chats,
)
from tests.conftest import tiny_llama


def test_k3_example_from_the_seed():
    log_prob = torch.tensor([-1.0, -2.0, -0.3])
    target = torch.tensor([-0.5, -2.5, -0.1])
    expected = torch.tensor([0.1487213, 0.1065307, 0.0214028])
    torch.testing.assert_close(
        k3_kl_token_estimate(target, log_prob), expected, atol=1e-7, rtol=1e-6
    )
    with pytest.raises(ValueError, match=r"same shape.*\(3,\).*\(2,\)"):
        k3_kl_token_estimate(target, log_prob[:2])


STUDENT = torch.tensor([[-1.0, -2.0, -0.3, 0.0], [-0.7, -1.1, 0.0, 0.0]])
TEACHER = torch.tensor([[-0.5, -2.5, -0.1, 0.0], [-0.2, -1.6, 0.0, 0.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])


def per_sequence_by_hand(direction):
    sums = []
    for s, t, m in zip(STUDENT, TEACHER, MASK, strict=True):
        d = (t - s) if direction == "reverse" else (s - t)
        sums.append(float(((d.exp() - 1 - d) * m).sum()))
    return sums, [float(m.sum()) for m in MASK]


@pytest.mark.parametrize("direction", ["reverse", "forward"])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_reductions_and_normalisation_by_hand(direction, normalize, reduction):
    sums, lengths = per_sequence_by_hand(direction)
    per_seq = [s / n for s, n in zip(sums, lengths, strict=True)] if normalize else sums
    expected = {"mean": sum(per_seq) / 2, "sum": sum(per_seq), "none": per_seq}[reduction]
    out = distillation_loss(
        STUDENT,
        TEACHER,
        MASK,
        kl_direction=direction,
        reduction=reduction,
        normalize_by_seq_length=normalize,
    )
    assert out.loss_distill.tolist() == pytest.approx(expected, rel=1e-6)
    assert out.kl_to_teacher.item() == pytest.approx(sum(per_seq) / 2, rel=1e-6)


def test_lists_of_variable_length_tensors_equal_padded():
    lists = distillation_loss(
        [STUDENT[0, :3], STUDENT[1, :2]],
        [TEACHER[0, :3], TEACHER[1, :2]],
        [MASK[0, :3], MASK[1, :2]],
    )
    padded = distillation_loss(STUDENT, TEACHER, MASK)
    assert lists.loss_distill.item() == pytest.approx(padded.loss_distill.item())


def test_gradient_reaches_the_student_only():
    student = STUDENT.clone().requires_grad_(True)
    teacher = TEACHER.clone().requires_grad_(True)
    distillation_loss(student, teacher, MASK).loss_distill.backward()
    assert teacher.grad is None
    assert student.grad[MASK.bool()].abs().min() > 0 and torch.all(student.grad[~MASK.bool()] == 0)
    assert not distillation_loss(STUDENT, TEACHER, MASK).kl_to_teacher.requires_grad


def test_errors():
    with pytest.raises(ValueError, match=r"sequences \[1\] have no token selected"):
        distillation_loss(STUDENT, TEACHER, torch.tensor([[1, 0, 0, 0], [0, 0, 0, 0]]))
    with pytest.raises(
        ValueError, match=r"different shapes: \[\(4,\), \(4,\)\] vs \[\(3,\), \(3,\)\]"
    ):
        distillation_loss(STUDENT, TEACHER[:, :3], MASK)
    with pytest.raises(ValueError, match=r"teacher log-probs are missing.*teacher_chat_logprobs"):
        distillation_loss(STUDENT, None, MASK)
    with pytest.raises(ValueError, match="kl_direction"):
        distillation_loss(STUDENT, TEACHER, MASK, kl_direction="sideways")


def test_zero_filled_teacher_logprobs_on_non_assistant_tokens_are_refused():
    assistant = torch.tensor([[0, 0, 1, 0], [0, 1, 0, 0]])
    zero_filled = TEACHER * assistant
    with pytest.raises(
        RuntimeError, match=r"3 of 3 scored non-assistant tokens.*assistant_only=True"
    ):
        distillation_loss(
            STUDENT, zero_filled, MASK, assistant_mask=assistant, assistant_only=False
        )
    distillation_loss(STUDENT, TEACHER, MASK, assistant_mask=assistant, assistant_only=False)


CHATS = [
    [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
    ],
    [{"role": "user", "content": "abc"}, {"role": "assistant", "content": "cba"}],
]


def test_assistant_masks_from_the_chat_template(char_tokenizer):
    tokens = tokenize_chats(char_tokenizer, CHATS)
    for ids, assistant, chat in zip(tokens.input_ids, tokens.assistant_mask, CHATS, strict=True):
        marked = char_tokenizer.decode(ids[assistant].tolist())
        assert marked == chat[-1]["content"] + "<|im_end|>\n"


def test_chat_loss_equals_the_tensor_loss_and_is_zero_against_itself(char_tokenizer):
    student, teacher = (
        tiny_llama(len(char_tokenizer), seed=1),
        tiny_llama(len(char_tokenizer), seed=2),
    )
    loss = ChatDistillationLoss(student, char_tokenizer, teacher=teacher)(CHATS)
    tokens = tokenize_chats(char_tokenizer, CHATS)
    by_hand = []
    for ids, assistant in zip(tokens.input_ids, tokens.assistant_mask, strict=True):
        with torch.no_grad():
            t, _ = sequence_logprobs(
                teacher, ids[None], torch.ones_like(ids)[None], assistant[None]
            )
            s, _ = sequence_logprobs(
                student, ids[None], torch.ones_like(ids)[None], assistant[None]
            )
        d = t[0] - s[0]
        by_hand.append(float(((d.exp() - 1 - d) * assistant).sum() / assistant.sum()))
    assert loss.loss_distill.item() == pytest.approx(sum(by_hand) / 2, rel=1e-5)
    loss.loss_distill.backward()
    assert student.model.embed_tokens.weight.grad is not None
    same = ChatDistillationLoss(student, char_tokenizer, teacher=student)(CHATS)
    assert same.loss_distill.item() == pytest.approx(0.0, abs=1e-7)


def test_precomputed_zero_filled_teacher_logprobs(char_tokenizer):
    student, teacher = (
        tiny_llama(len(char_tokenizer), seed=1),
        tiny_llama(len(char_tokenizer), seed=2),
    )
    teacher_logprobs = teacher_chat_logprobs(teacher, char_tokenizer, CHATS, assistant_only=True)
    direct = ChatDistillationLoss(student, char_tokenizer, teacher=teacher)(CHATS)
    given = ChatDistillationLoss(student, char_tokenizer)(CHATS, teacher_logprobs)
    assert given.loss_distill.item() == pytest.approx(direct.loss_distill.item(), rel=1e-6)
    with pytest.raises(RuntimeError, match="zero-filled"):
        ChatDistillationLoss(student, char_tokenizer, assistant_only=False)(CHATS, teacher_logprobs)
