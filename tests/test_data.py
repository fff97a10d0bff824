"""Prompt files, rendering and batching."""

import pytest

from opd.data.batching import CompositeBatches
from opd.data.builtin_tasks import generate_task_prompts
from opd.data.prompts import DataError, Prompt, load_jsonl_prompts
from opd.data.render import ChatRenderer
from opd.data.sources import load_prompts
from opd.demo.char_tokenizer import build_char_tokenizer


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_plain_and_chat_prompts(prompts_file):
    prompts = load_jsonl_prompts(prompts_file)
    assert prompts[0].messages == ({"role": "user", "content": "reverse abc"},)
    assert prompts[0].answer == "cba"
    assert prompts[6].messages[0]["role"] == "system"
    assert prompts[7].answer == "bac"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"prompt": "ok"', "malformed JSON"),
        ('{"prompt": "   "}', "empty prompt"),
        ('{"question": "x"}', "needs a 'prompt' string or a 'messages' list"),
        (
            '{"messages": [{"role": "robot", "content": "x"}]}',
            r"messages\[0\]\.role must be one of",
        ),
        ('["prompt"]', "expected a JSON object"),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path, line, message):
    path = write_lines(tmp_path / "p.jsonl", ['{"prompt": "fine"}', "", line])
    with pytest.raises(DataError, match=rf"{path}:3: {message}"):
        load_jsonl_prompts(path)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(DataError, match="prompt file not found"):
        load_prompts(str(tmp_path / "nope.jsonl"))
    with pytest.raises(DataError, match="no prompts"):
        load_jsonl_prompts(write_lines(tmp_path / "e.jsonl", [""]))


def test_chat_rendering_adds_generation_prompt_and_stops_at_end_of_turn():
    tokenizer = build_char_tokenizer()
    renderer = ChatRenderer(tokenizer)
    ids = renderer.prompt_ids([{"role": "user", "content": "hi"}])
    assert tokenizer.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert renderer.stop_token_ids == [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert renderer.stop_strings == []


def test_base_model_without_template_falls_back_to_plain_format():
    tokenizer = build_char_tokenizer(chat_template=None)
    with pytest.warns(UserWarning, match="no chat template"):
        renderer = ChatRenderer(tokenizer)
    text = renderer.render_text([{"role": "user", "content": "2+2?"}])
    assert text == "User: 2+2?\n\nAssistant:"
    assert renderer.stop_strings == ["\n\nUser:"]
    custom = ChatRenderer(
        build_char_tokenizer(chat_template=None),
        chat_template="Q: {{ messages[0]['content'] }}\nA:",
    )
    assert custom.render_text([{"role": "user", "content": "x"}]) == "Q: x\nA:"


def test_batches_are_seeded_reproducible_and_cover_each_prompt_once_per_pass():
    a = [Prompt(messages=({"role": "user", "content": f"a{i}"},)) for i in range(10)]
    b = [Prompt(messages=({"role": "user", "content": f"b{i}"},)) for i in range(7)]
    batches = CompositeBatches([a, b], [3, 2], ["a", "b"], seed=5)
    assert len(batches) == 3  # min(10 // 3, 7 // 2)
    again = CompositeBatches([a, b], [3, 2], ["a", "b"], seed=5)
    assert [batches.batch(i) for i in range(3)] == [again.batch(i) for i in range(3)]
    other_seed = CompositeBatches([a, b], [3, 2], ["a", "b"], seed=6)
    assert [other_seed.batch(i) for i in range(3)] != [batches.batch(i) for i in range(3)]
    seen = [item.prompt for i in range(3) for item in batches.batch(i) if item.dataset_index == 0]
    contents = [p.messages[0]["content"] for p in seen]
    assert len(contents) == 9 and len(set(contents)) == 9  # one pass: no prompt twice
    assert [item.dataset_index for item in batches.batch(0)] == [0, 0, 0, 1, 1]


def test_every_pass_reshuffles_and_any_step_can_be_asked_first():
    prompts = [Prompt(messages=({"role": "user", "content": f"p{i}"},)) for i in range(10)]
    batches = CompositeBatches([prompts], [4], ["p"], seed=3)
    passes = [
        [
            item.prompt.messages[0]["content"]
            for s in (2 * k, 2 * k + 1)
            for item in batches.batch(s)
        ]
        for k in range(4)
    ]
    for seen in passes:
        assert len(set(seen)) == 8  # each pass: 8 distinct prompts (2 batches of 4)
    assert len({tuple(seen) for seen in passes}) == 4  # no pass repeats another's order
    left_out = [frozenset(f"p{i}" for i in range(10)) - set(seen) for seen in passes]
    assert len(set(left_out)) > 1  # the two remainder prompts change between passes
    resumed = CompositeBatches([prompts], [4], ["p"], seed=3)
    assert resumed.batch(5) == batches.batch(5)  # a resumed run asks for step 5 first
    assert resumed.batch(0) == batches.batch(0)


def test_dataset_smaller_than_a_batch_is_refused():
    prompts = generate_task_prompts("reverse", seed=0, count=3)
    with pytest.raises(
        DataError, match="dataset 'small': 3 prompts, fewer than one batch of groups_per_batch=4"
    ):
        CompositeBatches([prompts], [4], ["small"], seed=0)


def test_builtin_tasks_and_grader():
    train = generate_task_prompts("reverse", seed=0, count=50)
    test = generate_task_prompts("reverse@test", seed=0, count=50)
    assert [p.messages for p in train[:5]] != [p.messages for p in test[:5]]
    word = train[0].messages[0]["content"].split()[1]
    assert train[0].answer == word[::-1]
    with pytest.raises(DataError, match="unknown built-in task"):
        load_prompts("demo:nope")


THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor "
    "%}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking "
    "%}<think>\n\n</think>\n\n{% endif %}"
)
"""Qwen3's way: the template thinks unless ``enable_thinking`` is false."""


def test_chat_template_kwargs_reach_the_template(base_config):
    from opd.config import config_from_dict
    from opd.trainer.loop import Trainer

    hello = [{"role": "user", "content": "hi"}]
    base_config["student"] |= {"chat_template": THINKING_TEMPLATE}
    thinking = Trainer(config_from_dict(base_config), progress=False).parts.renderer.render_text(
        hello
    )
    assert thinking == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    base_config["student"] |= {"chat_template_kwargs": {"enable_thinking": False}}
    quiet = Trainer(config_from_dict(base_config), progress=False).parts.renderer.render_text(hello)
    assert quiet == thinking + "<think>\n\n</think>\n\n"


def test_teacher_template_kwargs_without_its_template_are_refused(base_config):
    from opd.config import ConfigError, config_from_dict

    base_config["teacher"] |= {"chat_template_kwargs": {"enable_thinking": True}}
    with pytest.raises(
        ConfigError, match=r"teacher.chat_template_kwargs: read by the teacher's own template"
    ):
        config_from_dict(base_config)
