"""Objectives as components: the registry, what each declares, options in the config, a new one
plugged in."""

import ast
import dataclasses
from pathlib import Path

import pytest

from opd.config import ConfigError, config_from_dict, config_to_dict
from opd.objectives.base import REGISTRY, Objective, StudentRows, TargetRows, TokenLosses
from opd.objectives.registry import objectives
from opd.trainer.loop import Trainer

MINIMAL = {
    "student": {"model": "s"},
    "teacher": {"model": "t"},
    "datasets": [{"name": "a", "source": "p.jsonl"}],
}


def test_the_registry_holds_every_objective_with_what_it_needs():
    declared = {
        name: (
            cls.teacher_signal,
            cls.samples,
            cls.uses_advantages,
            [f.name for f in dataclasses.fields(cls)],
        )
        for name, cls in objectives().items()
    }
    assert declared == {
        "sampled_reverse_kl": ("logprobs", "student", True, []),
        "jsd": ("distribution", "any", False, ["beta"]),
        "k3": ("logprobs", "any", False, ["kl_direction"]),
        "nll": ("none", "reference", False, []),
        "topk_forward_kl": ("topk", "any", False, ["topk"]),
    }
    assert next(iter(objectives())) == "sampled_reverse_kl"  # the default comes first


@pytest.mark.parametrize(
    ("objective", "request_"),
    [
        ("sampled_reverse_kl", (0, False)),
        ({"name": "k3"}, (0, False)),
        ({"name": "jsd", "beta": 0.2}, (0, True)),
        ({"name": "topk_forward_kl", "topk": 7}, (7, False)),
        ("nll", None),
    ],
)
def test_each_objective_asks_the_teacher_for_what_it_reads(objective, request_):
    data_source = "teacher" if objective == "nll" else "student"
    config = config_from_dict(
        MINIMAL, [f"training.objective={objective}", f"training.data_source={data_source}"]
    )
    request = config.training.objective.teacher_request(0.7)
    assert (None if request is None else (request.topk, request.hidden)) == request_
    if request is not None:
        assert request.temperature == 0.7


def test_bare_names_and_mappings_give_equal_objectives_and_round_trip():
    bare = config_from_dict(MINIMAL, ["training.objective=jsd"])
    mapped = config_from_dict(MINIMAL, ["training.objective={name: jsd, beta: 0.5}"])
    assert bare.training.objective == mapped.training.objective
    assert config_to_dict(mapped)["training"]["objective"] == {"name": "jsd", "beta": 0.5}
    assert config_from_dict(config_to_dict(mapped)) == mapped


def test_an_option_may_be_overridden_under_a_bare_name():
    data = dict(MINIMAL, training={"objective": "jsd"})
    config = config_from_dict(data, ["training.objective.beta=0.25"])
    assert config.training.objective.beta == 0.25
    switched = config_from_dict(
        data, ["training.objective=k3", "training.objective.kl_direction=forward"]
    )
    assert switched.training.objective == objectives()["k3"](kl_direction="forward")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "training.objective={name: k3, beta: 0.5}",
            r"training\.objective\.beta: an option of objective 'jsd', not of 'k3' "
            r"\(its options: kl_direction\)",
        ),
        (
            "training.objective={name: nope}",
            r"training\.objective: 'nope' is not one of \['sampled_reverse_kl', ",
        ),
        (
            "training.objective={name: jsd, betta: 0.1}",
            r"training\.objective\.betta: unknown key; did you mean",
        ),
        ("training.objective={beta: 0.1}", r"training\.objective\.name: required key is missing"),
        (
            "training.beta=0.5",
            r"training\.beta: an option of objective 'jsd', set under training\.objective",
        ),
        ("training.topk=8", r"training\.topk: an option of objective 'topk_forward_kl'"),
        (
            "training.objective=[jsd]",
            r"training\.objective: expected an objective's name or a mapping",
        ),
    ],
)
def test_misplaced_and_unknown_options_are_named(override, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict(MINIMAL, [override])


@pytest.mark.parametrize(
    "key",
    [
        "kl_penalty_coef=2.0",
        "kl_discount_factor=0.5",
        "advantage_clip=5",
        "normalize_advantages=true",
        "advantage_logprobs=current",
        "loss_fn=ppo",
    ],
)
def test_policy_gradient_settings_are_refused_where_the_objective_has_no_advantages(key):
    with pytest.raises(
        ConfigError, match=rf"training\.{key.split('=')[0]}: shapes the advantages .* 'k3' has none"
    ):
        config_from_dict(MINIMAL, ["training.objective=k3", f"training.{key}"])


def test_no_code_outside_objectives_compares_with_an_objective_name():
    """The seam: config, trainer and teachers ask an objective what it needs, never which one it
    is."""
    names = set(objectives())
    source = Path(__file__).parents[1] / "src" / "opd"
    found = []
    for path in source.rglob("*.py"):
        if path.parent.name == "objectives":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare | ast.MatchValue):
                constants = [n.value for n in ast.walk(node) if isinstance(n, ast.Constant)]
                found += [f"{path.name}:{node.lineno} {c}" for c in constants if c in names]
    assert found == []


@pytest.fixture
def toy_objective():
    """A toy objective, defined for one test only: half the negative log-likelihood, one option."""
    objectives.cache_clear()

    @dataclasses.dataclass(frozen=True)
    class ScaledNLL(Objective):
        name = "toy_scaled_nll"
        teacher_signal = "none"
        samples = "reference"
        samples_reason = "would fit the student to itself"

        scale: float = 0.5

        def token_losses(self, student: StudentRows, targets: TargetRows) -> TokenLosses:
            logprobs_N, entropy_N = student.logprobs()
            return TokenLosses(-self.scale * logprobs_N, logprobs_N, entropy_N)

    yield ScaledNLL
    REGISTRY.pop(ScaledNLL.name)
    objectives.cache_clear()


def test_a_new_objective_is_one_class_and_trains_by_its_name(toy_objective, base_config):
    """Registered by defining it: the config, the trainer and the teachers need no change."""
    losses = {}
    for objective in ({"name": "toy_scaled_nll", "scale": 0.5}, "nll"):
        base_config["training"].update(objective=objective, data_source="teacher", max_steps=1)
        trainer = Trainer(config_from_dict(base_config), progress=False)
        batch = trainer.collect(0)
        assert batch.teacher is None  # it asked for no teacher answer: none was computed
        losses[str(objective)] = trainer.learn(batch)["loss"]
    assert losses["{'name': 'toy_scaled_nll', 'scale': 0.5}"] == pytest.approx(
        0.5 * losses["nll"], rel=1e-5
    )
    with pytest.raises(
        ConfigError, match=r"training\.objective\.scale: an option of objective 'toy_scaled_nll'"
    ):
        config_from_dict(base_config, ["training.objective={name: jsd, scale: 1.0}"])
