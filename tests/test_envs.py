"""Multi-turn environments: the calculator and retry episodes, the episode layout and its mask by
hand, environment tokens that never move the update, teachers that re-render episodes in their
own template or tokenizer, and bad input named before any work."""

from __future__ import annotations

import contextlib
import copy
import dataclasses

import pytest
import torch
from conftest import quick_to_stop, tiny_llama
from multi_turn_envs import OVERLAP, QuarterThenHalf

from opd.cli import main
from opd.config import config_from_dict
from opd.data.graders import exact_match
from opd.data.prompts import Prompt
from opd.data.render import ChatRenderer
from opd.data.sequences import Completion, build_rollout_batch
from opd.envs.calculator import Calculator, calculate
from opd.envs.registry import environments
from opd.envs.retry import Retry
from opd.errors import ConfigError, EpisodeError
from opd.objectives.advantages import reverse_kl_per_token
from opd.sampling.episodes import EpisodeSpec, play_episodes
from opd.teachers.alignment import TeacherFormat
from opd.trainer.loop import Trainer, train

CHATML_TOOL = "<|im_start|>tool\n"


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("4821+9377-1203", "12995"),
        ("2*(3+4)", "14"),
        ("7/2", "7/2"),
        ("-3 - -5", "2"),
        ("1,000 + 1", "1001"),
        ("1/0", "error: division by zero"),
        ("__import__('os')", "error: only numbers, + - * / and parentheses"),
        ("2**10", "error: only numbers, + - * / and parentheses"),
        ("4821+", "error: not an arithmetic expression"),
    ],
)
def test_the_calculator_answers_exactly_or_says_why_not(expression, value):
    assert calculate(expression) == value


def test_the_calculator_episode_answers_tool_calls_then_grades_the_final_answer():
    prompt = Prompt(({"role": "user", "content": "compute 4821+9377"},), answer="14198")
    episode = Calculator().start(prompt, exact_match)
    first = episode.step("<calc>4821+9377</calc>")
    assert not first.done and first.messages == ({"role": "tool", "content": "14198"},)
    assert episode.step(" 14198 ") == type(first)(
        done=True, reward=1.0, metrics={"tool_calls": 1.0}
    )
    wrong = Calculator(result_role="user").start(prompt, exact_match)
    assert wrong.step("14199").reward == 0.0


def test_retry_says_wrong_until_right():
    prompt = Prompt(({"role": "user", "content": "reverse abc"},), answer="cba")
    episode = Retry(hint=True).start(prompt, exact_match)
    first = episode.step("abc")
    assert not first.done and first.reward is None  # the grade comes once, at the end
    assert (
        first.messages[0]["content"]
        == "That is not right. Try again. (your answer scored 0.00 of 1)"
    )
    last = episode.step("cba")
    assert last.done and last.reward == 1.0 and last.metrics == {"attempts": 2.0, "first_try": 0.0}


def test_reply_tokens_are_what_the_template_renders_between_the_turns(char_tokenizer):
    renderer = ChatRenderer(char_tokenizer)
    history = [{"role": "user", "content": "compute 1+2"}]
    turn = char_tokenizer("<calc>1+2</calc>", add_special_tokens=False)["input_ids"] + [2]
    reply = renderer.reply_ids(history, turn, [{"role": "tool", "content": "3"}])
    assert char_tokenizer.decode(reply) == f"\n{CHATML_TOOL}3<|im_end|>\n<|im_start|>assistant\n"
    # the episode's tokens are the template's rendering of the whole conversation
    conversation = [
        *history,
        {"role": "assistant", "content": "<calc>1+2</calc>"},
        {"role": "tool", "content": "3"},
    ]
    assert renderer.prompt_ids(history) + turn + reply == renderer.prompt_ids(conversation)


def scripted(turns: list[list[str]], tokenizer, logprob: float = -0.5):
    """A turn sampler that writes ``turns[k][row]`` at turn k (the test's input, ending each with
    the end of turn), recording what it was asked."""
    asked = []

    def sample(rows, prompts, conversations, seeds, max_tokens):
        asked.append(
            (list(rows), [len(p) for p in prompts], list(seeds), max_tokens, conversations)
        )
        completions = []
        for row in rows:
            ids = tokenizer(turns[len(asked) - 1][row], add_special_tokens=False)["input_ids"] + [2]
            completions.append(
                Completion(
                    ids[:max_tokens],
                    [logprob] * min(len(ids), max_tokens),
                    len(ids) <= max_tokens,
                    7,
                )
            )
        return completions

    return sample, asked


def test_a_two_turn_episode_by_hand(char_tokenizer):
    """Turn 1 calls the tool, the environment's reply follows, turn 2 answers: the mask is 1 on
    the two turns only, the reverse KL (so the advantage) is 0 on the reply whatever the teacher
    says."""
    renderer = ChatRenderer(char_tokenizer)
    prompt = Prompt(({"role": "user", "content": "compute 1+2"},), answer="3")
    sample, asked = scripted([["<calc>1+2</calc>", "9"], ["3"]], char_tokenizer)
    specs = [
        EpisodeSpec(Calculator().start(prompt, exact_match), prompt.messages, 3, 100, "calc"),
        EpisodeSpec(Calculator().start(prompt, exact_match), prompt.messages, 3, 100, "calc"),
    ]
    prompt_ids = renderer.prompt_ids(prompt.messages)
    two, one = play_episodes(sample, renderer, [prompt_ids, prompt_ids], specs, [11, 12], 20)
    assert [a[0] for a in asked] == [[0, 1], [0]]  # only the row still playing samples turn 2
    assert asked[1][2] != [11]  # turn 2 draws from a seed of its own
    turn1 = len("<calc>1+2</calc>") + 1
    reply_text = f"\n{CHATML_TOOL}3<|im_end|>\n<|im_start|>assistant\n"
    reply = len(char_tokenizer(reply_text, add_special_tokens=False)["input_ids"])
    assert two.trajectory.turns == ((0, turn1), (turn1 + reply, turn1 + reply + 2))
    assert two.trajectory.replies == (({"role": "tool", "content": "3"},),)
    assert (two.trajectory.reward, two.trajectory.ended, two.finished) == (1.0, "done", True)
    assert asked[1][1] == [len(prompt_ids) + turn1 + reply]  # turn 2 continues the whole episode
    assert asked[1][4] == [  # and as messages: what a teacher with its own template renders
        [
            *prompt.messages,
            {"role": "assistant", "content": "<calc>1+2</calc>"},
            {"role": "tool", "content": "3"},
        ]
    ]
    assert (one.trajectory.turns, one.trajectory.reward) == (((0, 2),), 0.0)
    batch = build_rollout_batch([prompt_ids] * 2, [two, one], [0, 0], 0)
    start = len(prompt_ids)
    expected = torch.zeros_like(batch.mask_BT)
    expected[0, start : start + turn1] = 1
    expected[0, start + turn1 + reply : start + turn1 + reply + 2] = 1
    expected[1, start : start + 2] = 1
    assert torch.equal(batch.mask_BT, expected)
    teacher = torch.full_like(batch.mask_BT, -2.0)
    teacher[
        0, start + turn1 : start + turn1 + reply
    ] = -50.0  # a teacher appalled by the tool's reply
    kl = reverse_kl_per_token(batch.sampled_logprobs_BT, teacher, batch.mask_BT)
    assert torch.equal(kl, expected * 1.5)  # -0.5 - (-2.0) on the student's tokens, 0 elsewhere


def test_episode_limits_cut_and_mark_it(char_tokenizer):
    renderer = ChatRenderer(char_tokenizer)
    prompt = Prompt(({"role": "user", "content": "compute 1+2"},), answer="3")
    prompt_ids = renderer.prompt_ids(prompt.messages)
    calls = ["<calc>1</calc>"]
    sample, _ = scripted([calls, calls, calls], char_tokenizer)
    (out_of_turns,) = play_episodes(
        sample,
        renderer,
        [prompt_ids],
        [EpisodeSpec(Calculator().start(prompt, None), prompt.messages, 2, 500)],
        [0],
        20,
    )
    assert (
        len(out_of_turns.trajectory.turns),
        out_of_turns.trajectory.ended,
        out_of_turns.finished,
    ) == (
        2,
        "turns",
        False,
    )
    sample, asked = scripted([calls, calls, calls], char_tokenizer)
    (out_of_tokens,) = play_episodes(
        sample,
        renderer,
        [prompt_ids],
        [EpisodeSpec(Calculator().start(prompt, None), prompt.messages, 3, 45)],
        [0],
        20,
    )
    # a call of 15 tokens, the reply (21), then the second call cut to the 9 tokens left
    assert (out_of_tokens.trajectory.ended, len(out_of_tokens.token_ids), asked[-1][3]) == (
        "tokens",
        45,
        9,
    )
    assert out_of_tokens.trajectory.turns[-1] == (36, 45) and not out_of_tokens.finished


def test_an_episodes_reward_is_the_sum_of_its_steps_and_a_cut_one_gets_its_last_word(
    char_tokenizer,
):
    """The reference's total reward: each step's reward added up (0.25 then 0.5 is 0.75); an episode
    cut short keeps what it was given plus its ``cut`` reward: retry's last answer's grade, once."""
    renderer = ChatRenderer(char_tokenizer)
    prompt = Prompt(({"role": "user", "content": "reverse abc"},), answer="cba")
    prompt_ids = renderer.prompt_ids(prompt.messages)
    sample, _ = scripted([["a"], ["b"], ["c"]], char_tokenizer)
    (summed,) = play_episodes(
        sample,
        renderer,
        [prompt_ids],
        [EpisodeSpec(QuarterThenHalf().start(prompt, None), (), 3, 500)],
        [0],
        20,
    )
    assert (summed.trajectory.reward, summed.trajectory.ended) == (0.75, "done")
    sample, _ = scripted([["a"], ["b"]], char_tokenizer)
    (cut,) = play_episodes(
        sample,
        renderer,
        [prompt_ids],
        [EpisodeSpec(QuarterThenHalf().start(prompt, None), (), 1, 500)],
        [0],
        20,
    )
    assert (cut.trajectory.reward, cut.trajectory.ended) == (0.25, "turns")  # no cut() reward

    def partial(text: str, item: Prompt) -> float:  # half marks for the right first letter
        return 1.0 if text == item.answer else 0.5 * (text[:1] == item.answer[0])

    for turns, expected in ((["x", "cb", "c"], 0.5), (["cb", "x", "c"], 0.0)):
        sample, _ = scripted([[t] for t in turns], char_tokenizer)
        spec = EpisodeSpec(Retry().start(prompt, partial), prompt.messages, 2, 500)
        (retried,) = play_episodes(sample, renderer, [prompt_ids], [spec], [0], 20)
        # out of turns after two wrong answers: the second one's grade, not the sum of both
        assert (retried.trajectory.reward, retried.trajectory.ended) == (expected, "turns")


@pytest.fixture(scope="module")
def episode_models(tmp_path_factory, char_tokenizer):
    root = tmp_path_factory.mktemp("episodes")
    quick_to_stop(tiny_llama(len(char_tokenizer), seed=1)).save_pretrained(root / "student")
    tiny_llama(len(char_tokenizer), seed=2).save_pretrained(root / "teacher")
    for name in ("student", "teacher"):
        char_tokenizer.save_pretrained(root / name)
    return root


def episode_config(
    models, prompts_file, tmp_path, objective="sampled_reverse_kl", env=None
) -> dict:
    return {
        "log_path": str(tmp_path / "run"),
        "seed": 0,
        "student": {"model": str(models / "student"), "lora_rank": 0},
        "teacher": {"model": str(models / "teacher")},
        "datasets": [
            {
                "name": "rev",
                "source": str(prompts_file),
                "groups_per_batch": 4,
                "group_size": 2,
                "env": env
                or {"name": "multi_turn_envs:ReplyOnce", "max_turns": 3, "max_episode_tokens": 64},
            }
        ],
        "training": {
            "objective": objective,
            "learning_rate": 1e-2,
            "max_tokens": 6,
            "max_steps": 1,
        },
    }


def replies_mask(batch) -> torch.Tensor:
    """True on the environment's tokens: inside a completion, not the student's."""
    rows = batch.rollouts
    inside = torch.zeros_like(rows.mask_BT, dtype=torch.bool)
    for row, length in enumerate(rows.attention_mask_BT.sum(-1).tolist()):
        inside[row, rows.prompt_lengths[row] : length] = True
    return inside & ~rows.mask_BT.bool()


@pytest.mark.parametrize("objective", ["sampled_reverse_kl", "k3", "topk_forward_kl", "jsd"])
def test_the_teachers_scores_of_environment_tokens_never_move_the_update(
    episode_models, prompts_file, tmp_path, objective
):
    trainer = Trainer(
        config_from_dict(episode_config(episode_models, prompts_file, tmp_path, objective)),
        progress=False,
    )
    start = copy.deepcopy(trainer.parts.policy.model.state_dict())
    batch = trainer.collect(0)
    replies = replies_mask(batch)
    assert replies.any() and sum(len(t.turns) == 2 for t in batch.rollouts.trajectories) >= 2
    trainer.learn(copy.deepcopy(batch))
    updated = copy.deepcopy(trainer.parts.policy.model.state_dict())
    teacher = batch.teacher
    teacher.logprobs_BT[replies] = -30.0
    if teacher.topk_logprobs_BTK is not None:
        teacher.topk_logprobs_BTK[replies] = -30.0
        teacher.topk_ids_BTK[replies] = 5
    if teacher.hidden_BTD is not None:
        teacher.hidden_BTD[replies] = 100.0
    for share in teacher.shares or []:  # a batch composed from several teachers' answers
        share.hidden_BTD[replies] = 100.0
    trainer.parts.policy.model.load_state_dict(start)
    trainer.parts.optimizer.state.clear()
    trainer.parts.scheduler.last_epoch -= 1  # the same learning rate for the second update
    trainer.learn(batch)
    for name, value in trainer.parts.policy.model.state_dict().items():
        assert torch.equal(value, updated[name]), name
    assert any(not torch.equal(updated[name], start[name]) for name in start)


class OneTurnAtATime:
    """A turn stream over the HF engine that samples one pending turn per call, the last submitted
    first: a row's turns interleave with other rows' as a streaming engine's may."""

    def __init__(self, engine, params):
        self.engine, self.params, self.queue = engine, params, []

    def submit(self, key, prompt, seed, max_tokens):
        self.queue.append((key, prompt, seed, max_tokens))

    def finished(self, waiting=False):
        if not self.queue:
            return [] if waiting else None
        key, prompt, seed, max_tokens = self.queue.pop()
        params = dataclasses.replace(self.params, max_tokens=max_tokens)
        (completion,) = self.engine.rollout([prompt], params, seeds=[seed])
        return [(key, completion)]


class Streaming:
    """The run's HF engine, offering a turn stream as the vLLM engines do."""

    def __init__(self, engine):
        self.engine, self.streams = engine, 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    @contextlib.contextmanager
    def turn_stream(self, params):
        self.streams += 1
        yield OneTurnAtATime(self.engine, params)


@pytest.mark.parametrize(("max_tokens", "episode_tokens"), [(6, 64), (10, 30)])
def test_episodes_streamed_turn_by_turn_are_the_episodes_played_in_lock_step(
    episode_models, prompts_file, tmp_path, max_tokens, episode_tokens
):
    """Each row's next turn submitted when its environment answered, rows finishing in another
    order than the batch's: the same turns, seeds and limits as every row waiting for the
    slowest."""
    config = episode_config(episode_models, prompts_file, tmp_path)
    config["training"]["max_tokens"] = max_tokens
    config["datasets"][0]["env"]["max_episode_tokens"] = episode_tokens
    config = config_from_dict(config)
    lockstep = Trainer(config, progress=False)
    streamed = Trainer(config, progress=False)
    streamed.parts.engine = Streaming(streamed.parts.engine)
    expected, got = lockstep.collect(0).rollouts, streamed.collect(0).rollouts
    assert streamed.parts.engine.streams == 1
    assert got.trajectories == expected.trajectories
    assert torch.equal(got.input_ids_BT, expected.input_ids_BT)
    assert torch.equal(got.mask_BT, expected.mask_BT)
    torch.testing.assert_close(
        got.sampled_logprobs_BT, expected.sampled_logprobs_BT, atol=1e-5, rtol=0
    )
    ends = {(len(t.turns), t.ended) for t in got.trajectories}
    assert len(ends) > 1, (
        ends
    )  # episodes of different lengths or ends: the interleaving was exercised


def test_a_multi_turn_run_logs_its_episodes(episode_models, prompts_file, tmp_path):
    config = episode_config(episode_models, prompts_file, tmp_path)
    config["datasets"][0] |= {"eval_source": str(prompts_file), "eval_num_prompts": 4}
    config["eval_every"] = 1
    rows = train(config_from_dict(config), progress=False).metrics
    step = rows[0]
    assert 1.0 < step["episode/turns"] <= 2.0 and 0 <= step["episode/success"] <= 1
    assert step["teacher_kl/turn_1"] > 0 and step["teacher_kl/turn_2"] > 0
    assert (
        step["completion_len_mean"] < step["episode/len"]
    )  # the replies count in length, not in tokens trained
    assert 1.0 <= rows[-1]["test/rev/turns"] <= 2.0 and "test/rev/accuracy" in rows[-1]


def test_an_environment_rewarding_a_quarter_then_a_half_logs_three_quarters(
    episode_models, prompts_file, tmp_path
):
    env = {"name": "multi_turn_envs:QuarterThenHalf", "max_turns": 2, "max_episode_tokens": 200}
    config = episode_config(episode_models, prompts_file, tmp_path, env=env)
    config["training"]["max_tokens"] = 40  # room for the quick-stopping student to end each turn
    (step,) = train(config_from_dict(config), progress=False).metrics
    assert step["episode/cut"] == 0.0 and step["episode/turns"] == 2.0
    assert step["episode/reward"] == pytest.approx(0.75) and step["reward/mean"] == pytest.approx(
        0.75
    )


def test_a_teacher_with_its_own_template_reads_the_episode_in_it(char_tokenizer):
    """The same tokenizer, another template: the teacher's tokens are its template's rendering of
    the whole conversation, the student's turns (ends of turn the teacher's) scored, the reply
    not."""
    template = (
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}<|im_end|>{% endfor %}{% if "
        "add_generation_prompt %}[assistant] {% endif %}"
    )
    teacher_tokenizer = copy.deepcopy(char_tokenizer)
    renderer = ChatRenderer(teacher_tokenizer, template)
    fmt = TeacherFormat(renderer, char_tokenizer, [2], cross_tokenizer=False)
    student = ChatRenderer(char_tokenizer)
    messages = ({"role": "user", "content": "compute 1+2"},)
    turn1 = char_tokenizer("<calc>1+2</calc>", add_special_tokens=False)["input_ids"] + [2]
    reply = student.reply_ids(list(messages), turn1, [{"role": "tool", "content": "3"}])
    turn2 = char_tokenizer("3", add_special_tokens=False)["input_ids"] + [2]
    from opd.data.sequences import Trajectory

    trajectory = Trajectory(
        ((0, len(turn1)), (len(turn1) + len(reply), len(turn1) + len(reply) + 2)),
        (({"role": "tool", "content": "3"},),),
    )
    built = fmt.build(messages, turn1 + reply + turn2, trajectory)
    text = teacher_tokenizer.decode(built.token_ids)
    assert (
        text == "[user] compute 1+2<|im_end|>[assistant] <calc>1+2</calc><|im_end|>"
        "[tool] 3<|im_end|>[assistant] 3<|im_end|>"
    )
    scored = teacher_tokenizer.decode(
        [t for t, m in zip(built.token_ids, built.score_mask, strict=True) if m]
    )
    assert scored == "<calc>1+2</calc><|im_end|>3<|im_end|>"
    assert [p.length for p in built.turns] == [len(turn1), 2]


def test_unknown_environment_names_the_registered_ones(base_config):
    base_config["datasets"][0]["env"] = {"name": "calculater"}
    with pytest.raises(
        ConfigError,
        match=r"datasets\[0\]\.env\.name: 'calculater' is not a registered environment "
        r"\(did you mean 'calculator'\?\); registered: \['calculator', 'retry'\]",
    ):
        config_from_dict(base_config)
    assert {"calculator", "retry"} <= set(environments())


def test_an_import_path_that_does_not_load_names_the_module_and_the_error(base_config):
    base_config["datasets"][0]["env"] = {"name": "no_such_pkg.envs:MyEnv"}
    with pytest.raises(
        ConfigError,
        match=r"cannot import module 'no_such_pkg\.envs' for 'no_such_pkg\.envs:MyEnv': "
        r"ModuleNotFoundError",
    ):
        config_from_dict(base_config)
    base_config["datasets"][0]["env"] = {"name": "multi_turn_envs:Missing"}
    with pytest.raises(ConfigError, match=r"multi_turn_envs\.Missing: no such name"):
        config_from_dict(base_config)
    base_config["datasets"][0]["env"] = {"name": "calculator", "result_role": "system"}
    with pytest.raises(
        ConfigError,
        match=r"datasets\[0\]\.env\.result_role: 'system' is not one of \['tool', 'user'\]",
    ):
        config_from_dict(base_config)
    base_config["datasets"][0]["env"] = {"name": "calculator", "max_turn": 3}
    with pytest.raises(
        ConfigError,
        match=r"datasets\[0\]\.env\.max_turn: not an option of environment 'calculator'",
    ):
        config_from_dict(base_config)


def test_an_environment_that_answers_with_no_messages_stops_the_run_naming_it(
    episode_models, prompts_file, tmp_path, capsys
):
    config = episode_config(
        episode_models, prompts_file, tmp_path, env={"name": "multi_turn_envs:AnswersText"}
    )
    with pytest.raises(
        EpisodeError,
        match=r"datasets\[0\] \(rev\): the environment's answer to turn 1 is str 'the tool says "
        r"42', "
        r"not an opd.envs.base.Step",
    ):
        train(config_from_dict(config), progress=False)
    import yaml

    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config | {"log_path": str(tmp_path / "cli")}))
    assert main(["train", str(path), "--no-progress"]) != 0
    error = capsys.readouterr().err
    assert "the environment's answer to turn 1 is str" in error and "Traceback" not in error


def test_retry_without_answers_is_refused_before_any_work(base_config, tmp_path):
    base_config["datasets"][0] |= {"env": {"name": "retry"}, "grader": "none"}
    with pytest.raises(
        ConfigError, match=r"datasets\[0\]\.env: environment 'retry' cannot start an episode"
    ):
        Trainer(config_from_dict(base_config), progress=False)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("streamed", [False, True], ids=["lockstep", "streamed"])
def test_an_environment_with_step_workers_answers_episodes_at_once_and_plays_the_same_ones(
    episode_models, prompts_file, tmp_path, streamed
):
    """``env.step_workers: 4``: a waiting tool's answers overlap, 4 at most (none with the default),
    in lock step and streamed, and the episodes are those played one answer at a time."""
    env = {
        "name": "multi_turn_envs:SlowReply",
        "max_turns": 3,
        "max_episode_tokens": 64,
        "delay": 0.2,
    }
    played, most = {}, {}
    for workers in (1, 4):
        config = episode_config(
            episode_models, prompts_file, tmp_path, env=dict(env, step_workers=workers)
        )
        trainer = Trainer(config_from_dict(config), progress=False)
        if streamed:
            trainer.parts.engine = Streaming(trainer.parts.engine)
        OVERLAP.most = 0
        played[workers] = trainer.collect(0).rollouts
        most[workers] = OVERLAP.most
    assert most == {1: 1, 4: 4}
    assert sum(len(t.turns) == 2 for t in played[1].trajectories) >= 2
    assert played[4].trajectories == played[1].trajectories
    assert torch.equal(played[4].input_ids_BT, played[1].input_ids_BT)


def test_an_environment_that_fails_in_its_thread_stops_the_play_with_its_error(char_tokenizer):
    class Broken:
        def step(self, text):
            raise RuntimeError("the sandbox is down")

    prompt = Prompt(({"role": "user", "content": "x"},), answer="y")
    sample, _ = scripted([["a", "b"]], char_tokenizer)
    specs = [EpisodeSpec(Broken(), prompt.messages, 2, 40, "datasets[0] (x)", step_workers=2)] * 2
    with pytest.raises(RuntimeError, match="the sandbox is down"):
        play_episodes(sample, ChatRenderer(char_tokenizer), [[5, 6], [5, 6]], specs, [0, 1], 10)


@pytest.mark.parametrize("workers", [0, -1, True, 1.5, None])
def test_step_workers_must_be_a_whole_number_from_1(base_config, workers):
    base_config["datasets"][0]["env"] = {"name": "calculator", "step_workers": workers}
    with pytest.raises(
        ConfigError,
        match=rf"datasets\[0\]\.env\.step_workers: must be an integer >= 1, got {workers!r}",
    ):
        config_from_dict(base_config)
