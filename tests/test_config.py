"""Config loading: every mistake names its field."""

import subprocess
import sys

import pytest
import yaml

from opd.config import ConfigError, config_from_dict, config_to_dict, load_config

MINIMAL = {
    "student": {"model": "s"},
    "teacher": {"model": "t"},
    "datasets": [{"name": "a", "source": "p.jsonl"}],
}


def issue_example() -> dict:
    """The config the core issue says a user must be able to write."""
    return yaml.safe_load(
        """
log_path: runs/demo
seed: 0
student: {model: PATH_OR_ID, lora_rank: 32, dtype: auto, device: auto}
teacher: {model: PATH_OR_ID}
datasets:
  - {name: arith, source: prompts.jsonl, groups_per_batch: 4, group_size: 2}
training:
  learning_rate: 1.0e-4
  max_tokens: 64
  temperature: 1.0
  kl_penalty_coef: 1.0
  kl_discount_factor: 0.0
  loss_fn: importance_sampling
  num_substeps: 1
  max_steps: 20
"""
    )


def test_issue_example_is_accepted_and_round_trips():
    config = config_from_dict(issue_example())
    assert config.student.lora_rank == 32
    assert config.training.learning_rate == pytest.approx(1e-4)
    assert config.datasets[0].group_size == 2
    assert config_from_dict(config_to_dict(config)) == config


def test_unknown_key_is_named_with_a_suggestion():
    data = issue_example()
    data["training"]["learnig_rate"] = 1.0
    with pytest.raises(
        ConfigError,
        match=r"training\.learnig_rate: unknown key; did you mean 'training\.learning_rate'",
    ):
        config_from_dict(data)


def test_unknown_nested_dataset_key():
    data = dict(MINIMAL, datasets=[{"name": "a", "source": "p", "group_sise": 2}])
    with pytest.raises(
        ConfigError,
        match=r"datasets\[0\]\.group_sise: unknown key; did you mean 'datasets\[0\]\.group_size'",
    ):
        config_from_dict(data)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("training.learning_rate=fast", r"training\.learning_rate: expected float"),
        (
            "training.loss_fn=ppo2",
            r"training\.loss_fn: 'ppo2' is not one of .* \(did you mean 'ppo'\?\)",
        ),
        ("datasets.0.group_size=0", r"datasets\[0\]\.group_size: must be >= 1, got 0"),
        ("datasets.0.groups_per_batch=-1", r"datasets\[0\]\.groups_per_batch: must be >= 1"),
        ("training.temperature=0", r"training\.temperature: must be > 0"),
        ("training.kl_discount_factor=1.0", r"training\.kl_discount_factor: must be in \[0, 1\)"),
        ("training.advantage_clip=0", r"training\.advantage_clip: must be > 0"),
        (
            "training.loss_fn_config.beta=0.1",
            r"training\.loss_fn_config\.beta: not a knob of loss_fn 'importance_sampling'",
        ),
        ("training.max_steps=2.5", r"training\.max_steps: .*integer"),
        ("student.lora_rank=-4", r"student\.lora_rank: must be >= 0"),
        (
            "training.objective=jsdd",
            r"training\.objective: 'jsdd' is not one of .* \(did you mean 'jsd'\?\)",
        ),
        (
            "training.objective={name: k3, kl_direction: up}",
            r"training\.objective\.kl_direction: 'up' is not one of \['reverse', 'forward'\]",
        ),
        (
            "training.objective={name: jsd, beta: 1.5}",
            r"training\.objective\.beta: must be in \[0, 1\], got 1\.5",
        ),
        ("training.lmbda=-0.1", r"training\.lmbda: must be in \[0, 1\]"),
        (
            "training.objective={name: topk_forward_kl, topk: 0}",
            r"training\.objective\.topk: must be > 0",
        ),
        (
            "training.objective=nll",
            r"training\.data_source: 'student' includes student samples.*'nll'",
        ),
    ],
)
def test_bad_values_are_named(override, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict(MINIMAL, [override])


def test_missing_required_key():
    with pytest.raises(ConfigError, match=r"^teacher: required key is missing"):
        config_from_dict({"student": {"model": "s"}, "datasets": [{"name": "a", "source": "p"}]})


def test_overrides_parse_yaml_values_and_reach_list_items():
    config = config_from_dict(
        MINIMAL,
        [
            "training.max_steps=5",
            "training.learning_rate=3e-5",
            "datasets.0.name=b",
            "student.lora_rank=0",
            "training.loss_fn=ppo",
            "training.loss_fn_config.clip_high_threshold=1.3",
        ],
    )
    assert config.training.max_steps == 5
    assert config.training.learning_rate == pytest.approx(3e-5)
    assert config.datasets[0].name == "b"
    assert config.student.lora_rank == 0
    assert config.training.loss_fn_config == {"clip_high_threshold": 1.3}


def test_an_unset_learning_rate_is_the_default_of_the_mode_and_is_recorded():
    lora = config_from_dict(MINIMAL)
    full = config_from_dict(MINIMAL, ["student.lora_rank=0"])
    assert lora.training.learning_rate == 1e-3 and full.training.learning_rate == 3e-5
    assert config_to_dict(full)["training"]["learning_rate"] == 3e-5
    assert config_from_dict(config_to_dict(full)) == full
    chosen = config_from_dict(MINIMAL, ["student.lora_rank=0", "training.learning_rate=3e-4"])
    assert chosen.training.learning_rate == 3e-4


def test_an_unset_batch_shape_is_16_prompts_of_one_sample_or_4_of_4_with_a_reward():
    plain = config_from_dict(MINIMAL).datasets[0]
    assert (plain.groups_per_batch, plain.group_size) == (16, 1)
    rewarded = config_from_dict(MINIMAL, ["training.reward_coef=1"]).datasets[0]
    assert (rewarded.groups_per_batch, rewarded.group_size) == (
        4,
        4,
    )  # a group to centre each reward
    wide = config_from_dict(MINIMAL, ["datasets.0.group_size=8"]).datasets[0]
    assert (wide.groups_per_batch, wide.group_size) == (2, 8)  # still 16 samples a step
    few = config_from_dict(MINIMAL, ["datasets.0.groups_per_batch=3"]).datasets[0]
    assert (few.groups_per_batch, few.group_size) == (3, 1)
    with pytest.raises(ConfigError, match=r"datasets\[0\]\.group_size: .* a group of 1 sample"):
        config_from_dict(MINIMAL, ["training.reward_coef=1", "datasets.0.group_size=1"])
    resolved = config_from_dict(MINIMAL)
    assert config_to_dict(resolved)["datasets"][0]["group_size"] == 1  # recorded as resolved
    assert config_from_dict(config_to_dict(resolved)) == resolved


def test_the_reverse_kl_is_refused_on_batches_the_student_did_not_sample():
    with pytest.raises(
        ConfigError,
        match=r"training\.data_source: 'teacher' .* training\.objective 'sampled_reverse_kl'",
    ):
        config_from_dict(
            MINIMAL, ["training.objective=sampled_reverse_kl", "training.data_source=teacher"]
        )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["training.off_policy_objective=nll"],
            r"training\.off_policy_objective: applies to the teacher's steps of data_source: "
            r"mixed; with "
            r"'student'",
        ),
        (
            ["training.data_source=mixed", "training.off_policy_objective=sampled_reverse_kl"],
            r"training\.off_policy_objective 'sampled_reverse_kl' is a policy gradient on the "
            r"student's own "
            r"samples; set training\.off_policy_objective to one that works off-policy",
        ),
        (
            ["training.data_source=mixed", "training.objective=nll"],
            r"training\.objective 'nll' on them would fit .* or name it in "
            r"training\.off_policy_objective",
        ),
    ],
)
def test_an_objective_per_source_is_checked_against_its_batches(overrides, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict(MINIMAL, overrides)


def test_mixed_runs_one_objective_on_each_source_and_records_both():
    config = config_from_dict(
        MINIMAL,
        [
            "training.data_source=mixed",
            "training.objective=sampled_reverse_kl",
            "training.off_policy_objective=nll",
        ],
    )
    training = config.training
    assert [training.objective_for(s).name for s in ("student", "teacher")] == [
        "sampled_reverse_kl",
        "nll",
    ]
    again = config_from_dict(config_to_dict(config))
    assert again.training.off_policy_objective == training.off_policy_objective
    assert config_from_dict(MINIMAL).training.objective_for("teacher").name == "topk_forward_kl"
    crossed = config_from_dict(
        MINIMAL, ["teacher.cross_tokenizer=true", "training.data_source=mixed"]
    ).training
    # nothing set: the reverse KL on the student's steps, the teacher's text learnt by its
    # likelihood
    assert [crossed.objective_for(s).name for s in ("student", "teacher")] == [
        "sampled_reverse_kl",
        "nll",
    ]


def test_an_unset_objective_is_the_topk_forward_kl_where_it_can_serve():
    default = config_from_dict(MINIMAL).training.objective
    assert (default.name, default.topk) == ("topk_forward_kl", 20)
    assert (
        config_from_dict(MINIMAL, ["training.data_source=teacher"]).training.objective.name
        == "topk_forward_kl"
    )
    remote = ["teacher.backend=sglang", "teacher.base_url=http://127.0.0.1:30000"]
    assert config_from_dict(MINIMAL, remote).training.objective.name == "topk_forward_kl"


@pytest.mark.parametrize(
    "overrides",
    [
        ["teacher.cross_tokenizer=true"],  # its defaults were measured with the reverse KL
        ["training.loss_fn=ppo"],  # a policy-gradient setting asks for the policy gradient
        ["training.kl_penalty_coef=0.5"],
        [
            "teacher.backend=sglang",
            "teacher.base_url=http://127.0.0.1:30000",
            "training.temperature=0.7",
        ],
    ],
)
def test_an_unset_objective_is_the_reverse_kl_where_the_top_k_cannot_serve_or_was_not_measured(
    overrides,
):
    objective = config_from_dict(MINIMAL, overrides).training.objective
    assert objective.name == "sampled_reverse_kl"
    named = config_from_dict(MINIMAL, [*overrides, "training.objective=sampled_reverse_kl"])
    assert named.training.objective == objective


def test_override_does_not_mutate_the_input():
    data = {
        "student": {"model": "s"},
        "teacher": {"model": "t"},
        "datasets": [{"name": "a", "source": "p"}],
    }
    config_from_dict(data, ["student.lora_rank=0"])
    assert "lora_rank" not in data["student"]


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match=r"expected dotted\.key=value"):
        config_from_dict(MINIMAL, ["training.max_steps"])
    with pytest.raises(ConfigError, match="not an index"):
        config_from_dict(MINIMAL, ["datasets.3.name=x"])


def test_duplicate_dataset_names():
    data = dict(MINIMAL, datasets=[{"name": "a", "source": "p"}, {"name": "a", "source": "q"}])
    with pytest.raises(ConfigError, match="names must be unique"):
        config_from_dict(data)


def test_load_config_names_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(dict(MINIMAL, sed=1)))
    with pytest.raises(ConfigError, match=rf"{path}: sed: unknown key; did you mean 'seed'"):
        load_config(path)
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")


def test_cli_start_up_leaves_the_trainer_unimported():
    """`opd --help` and config errors need no trainer: peft and the loop load on first use of
    opd.train."""
    code = (
        "import sys, opd.cli, opd; print('peft' in sys.modules, 'opd.trainer.loop' in "
        "sys.modules); from opd.trainer.loop import train; print(opd.train is train)"
    )
    output = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    )
    assert output.stdout.split() == ["False", "False", "True"]


@pytest.mark.parametrize(
    ("recorded", "message"),
    [
        (
            "training: {learning_rate: fast}\n",
            r"config\.yaml: training\.learning_rate: expected a number",
        ),
        (
            "training: {objective: {name: nope}}\n",
            r"config\.yaml: training\.objective: 'nope' is not one of",
        ),
        ("training: [unclosed\n", r"config\.yaml: the run to resume has an unreadable config"),
    ],
)
def test_a_run_to_resume_whose_record_is_broken_is_refused_naming_the_file(
    tmp_path, recorded, message
):
    (tmp_path / "config.yaml").write_text(recorded)
    with pytest.raises(ConfigError, match=message):
        config_from_dict(dict(MINIMAL, log_path=str(tmp_path)))
    named = ["training.learning_rate=1e-4", "training.objective=sampled_reverse_kl"]
    if "unreadable" not in message:
        assert (
            config_from_dict(dict(MINIMAL, log_path=str(tmp_path)), named).training.learning_rate
            == 1e-4
        )
