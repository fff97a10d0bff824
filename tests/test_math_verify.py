"""``grader: math_verify``: answers compared as mathematics (Hugging Face's Math-Verify), on its own
examples and on hand-made pairs: equal forms, unequal ones, unparsable ones."""

from __future__ import annotations

import pytest

from opd.config import ConfigError, config_from_dict
from opd.data import graders
from opd.data.graders import GRADERS, math_verify_score
from opd.data.prompts import Prompt


def grade(completion: str, answer: str) -> float:
    return math_verify_score(completion, Prompt([{"role": "user", "content": "q"}], answer=answer))


EQUAL = [
    # Math-Verify's own examples (its README): a union of sets, and a fraction against a decimal
    ("${1,2,3,4}$", "${1,3} \\cup {2,4}$"),
    ("The answer is $\\boxed{0.5}$", "$\\frac{1}{2}$"),
    ("The answer is $\\boxed{\\frac{1}{2}}$", "\\frac{1}{2}"),
    ("So x = 0.5", "1/2"),
    ("$\\boxed{\\{1, 2, 3\\}}$", "\\{3, 2, 1\\}"),
    ("$\\boxed{(0, 1]}$", "(0,1]"),
    ("The result is \\boxed{2\\sqrt{2}}", "\\sqrt{8}"),
    ("2 + 3 = 5, so the answer is 5", "5"),
    ("\\boxed{x^2+2x+1}", "(x+1)^2"),
    ("\\boxed{10\\%}", "0.1"),
    ("$\\boxed{-7}$", "-7"),
    ("\\boxed{\\dfrac{3}{4}}", "0.75"),
    ("\\boxed{1,000}", "1000"),
    ("The final answer is $\\boxed{42}$.", "42"),
    ("$\\boxed{\\frac{\\pi}{2}}$", "\\pi/2"),
    ("$\\boxed{2^{10}}$", "1024"),
    ("$\\boxed{3\\cdot 4}$", "12"),
    ("$\\boxed{[1, 3)}$", "[1,3)"),
]
UNEQUAL = [
    ("We get \\boxed{3}", "4"),
    ("$\\boxed{7}$", "-7"),
    ("\\boxed{\\pi}", "3.14159"),
    ("$\\boxed{\\frac{1}{3}}$", "0.33"),
    ("$\\boxed{\\{1, 2\\}}$", "\\{1, 2, 3\\}"),
    ("$\\boxed{(0, 1)}$", "(0,1]"),
    ("\\boxed{x^2+1}", "(x+1)^2"),
    ("$\\boxed{\\sqrt{2}}$", "2"),
    ("The answer is $\\boxed{12}$", "21"),
    ("\\boxed{1001}", "1000"),
]
UNPARSABLE = [
    ("no idea", "4"),
    ("", "4"),
    ("I cannot solve this.", "\\frac{1}{2}"),
    ("\\boxed{", "3"),
    ("$\\boxed{5}$", ""),
    ("$\\boxed{5}$", "not a number"),
]


@pytest.mark.parametrize(("completion", "answer"), EQUAL)
def test_equal_forms_grade_1(completion, answer):
    assert grade(completion, answer) == 1.0


@pytest.mark.parametrize(("completion", "answer"), UNEQUAL + UNPARSABLE)
def test_unequal_or_unparsable_answers_grade_0(completion, answer):
    assert grade(completion, answer) == 0.0


def test_it_is_a_grader_a_config_can_name(base_config):
    assert GRADERS["math_verify"] is math_verify_score
    config = config_from_dict(base_config, ["datasets.0.grader=math_verify"])
    assert config.datasets[0].grader == "math_verify"


def test_without_the_package_the_config_is_refused_with_the_install_command(
    base_config, monkeypatch
):
    monkeypatch.setattr(graders, "math_verify_available", lambda: False)
    monkeypatch.setattr("opd.config.datasets.math_verify_available", lambda: False)
    with pytest.raises(
        ConfigError,
        match=r"datasets\[0\]\.grader: 'math_verify' needs the math-verify package.*"
        r"pip install 'opd\[math\]'",
    ):
        config_from_dict(base_config, ["datasets.0.grader=math_verify"])
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'opd\[math\]'"):
        grade("\\boxed{1}", "1")
