"""The watchdog on constructed metric streams: each symptom named once, healthy runs left alone."""

from __future__ import annotations

import pytest

from opd.cli import main
from opd.runs.metrics import read_jsonl
from opd.runs.watchdog import Watchdog


def healthy(step: int) -> dict:
    """A run that learns: KL falling with noise, entropy easing, steady gradients."""
    wiggle = 0.05 * (-1) ** step
    return {
        "step": step,
        "teacher_kl": 1.0 / (1 + 0.1 * step) + wiggle,
        "entropy": 2.0 - 0.01 * step,
        "kl_sample_train": 1e-4 * (-1) ** step,
        "grad_norm": 1.0 + 0.3 * ((step * 7) % 5) / 5,
    }


def names(stream: list[dict]) -> list[tuple[int, str]]:
    watchdog = Watchdog()
    return [(row["step"], symptom.name) for row in stream for symptom in watchdog.check(row)]


def test_a_healthy_run_raises_nothing():
    stream = [healthy(step) for step in range(100)]
    stream[10] |= {"test/rev/accuracy": 0.50}
    stream[50] |= {"test/rev/accuracy": 0.45}  # a dip within noise
    assert names(stream) == []


def test_entropy_collapse_is_named_once_when_it_falls_below_a_tenth():
    stream = [healthy(step) | {"entropy": 2.0 * 0.7**step} for step in range(20)]
    # 0.7**6 = 0.118 and 0.7**7 = 0.082: step 7 is the first below a tenth of step 0's entropy
    assert names(stream) == [(7, "entropy_collapse")]


def test_teacher_kl_rising_five_steps_in_a_row():
    stream = [healthy(step) for step in range(10)]
    stream += [healthy(step) | {"teacher_kl": 0.5 + 0.1 * (step - 10)} for step in range(10, 20)]
    # step 9's KL is 1 / 1.9 - 0.05 = 0.476 < 0.5 at step 10: steps 9..14 are the first six
    # rising values (five rises in a row)
    assert names(stream) == [(14, "teacher_kl_rising")]


def test_sampler_and_trainer_apart_and_exploding_gradients():
    stream = [healthy(step) for step in range(8)]
    stream.append(healthy(8) | {"kl_sample_train": -0.3})
    stream.append(healthy(9) | {"grad_norm": 50.0})
    stream.append(
        healthy(10) | {"grad_norm": 80.0, "kl_sample_train": 0.5}
    )  # already named: silent
    # the gradient's second spike in a row is the sign (one spike alone is not: below)
    assert names(stream) == [(8, "kl_sample_train"), (10, "grad_norm_exploding")]


def demo_run_with_one_clipped_spike() -> list[dict]:
    """``opd train examples/demo.yaml training.max_steps=20`` as a user saw it: gradient norms of
    4-7 with one spike of 63.6 at step 9, clipped (max_grad_norm 1.0), the KL going on down."""
    norms = [
        6.1,
        5.2,
        4.8,
        4.69,
        4.3,
        5.0,
        4.5,
        4.9,
        4.2,
        63.6,
        4.4,
        6.8,
        5.3,
        4.1,
        7.0,
        4.6,
        5.5,
        4.0,
        6.2,
        4.9,
    ]
    return [healthy(step) | {"grad_norm": norm} for step, norm in enumerate(norms)]


def test_one_clipped_spike_that_the_next_step_forgets_is_not_divergence(base_config):
    from opd.config import config_from_dict

    assert names(demo_run_with_one_clipped_spike()) == []
    watchdog = Watchdog(config_from_dict(base_config))
    assert [s for row in demo_run_with_one_clipped_spike() for s in watchdog.check(row)] == []


def test_a_spike_the_teacher_kl_follows_up_is_reported_the_step_after():
    stream = demo_run_with_one_clipped_spike()[:12]
    stream[10]["teacher_kl"] = 3.0  # the step after the spike: KL three times its median so far
    assert names(stream) == [(10, "grad_norm_exploding")]


def test_the_gradient_advice_never_names_a_setting_already_set(base_config):
    from opd.config import config_from_dict

    stream = [healthy(step) for step in range(8)] + [healthy(8) | {"grad_norm": 50.0}]
    stream.append(healthy(9) | {"grad_norm": 60.0})
    for clip, says, never in (
        (
            1.0,
            "already clipped to training.max_grad_norm 1: lower training.learning_rate",
            "set training",
        ),
        (None, "Lower training.learning_rate, or set training.max_grad_norm", "already clipped"),
    ):
        base_config["training"]["max_grad_norm"] = clip
        watchdog = Watchdog(config_from_dict(base_config))
        (symptom,) = [s for row in stream for s in watchdog.check(row)]
        assert says in symptom.message and never not in symptom.message


def test_the_sampler_advice_names_only_settings_the_run_has(base_config):
    from opd.config import config_from_dict

    stream = [healthy(0) | {"kl_sample_train": 0.4}]
    (plain,) = Watchdog(config_from_dict(base_config)).check(stream[0])
    assert "max_staleness" not in plain.message and "sampling_dtype" not in plain.message
    base_config["training"]["max_staleness"] = 1
    (ahead,) = Watchdog(config_from_dict(base_config)).check(stream[0])
    assert "training.max_staleness" in ahead.message


def test_a_gradient_spike_in_the_first_steps_has_no_baseline_yet():
    stream = [healthy(0), healthy(1) | {"grad_norm": 100.0}] + [
        healthy(step) for step in range(2, 6)
    ]
    assert names(stream) == []


def test_falling_held_out_accuracy_names_the_dataset():
    stream = [healthy(0) | {"test/rev/accuracy": 0.6, "test/sum/accuracy": 0.3}]
    stream += [healthy(step) for step in range(1, 5)]
    stream.append({"step": 5, "test/rev/accuracy": 0.45, "test/sum/accuracy": 0.35})
    watchdog = Watchdog()
    found = [symptom for row in stream for symptom in watchdog.check(row)]
    assert [s.name for s in found] == ["accuracy_falling"]
    assert "test/rev/accuracy fell from 60.0% to 45.0%" in found[0].message
    assert "training.learning_rate" in found[0].message


def accuracy_drop(first: float, last: float, prompts: int) -> list[tuple[int, str]]:
    key, size = "test/reverse/accuracy", "test/reverse/num_prompts"
    stream = [healthy(0) | {key: first, size: prompts}] + [healthy(step) for step in range(1, 10)]
    return names([*stream, healthy(10) | {key: last, size: prompts}])


def test_an_accuracy_dip_within_the_noise_of_a_small_held_out_set_is_not_reported():
    """The case a new user met: 38 of 64 right, then 31 of 64. Two accuracies near 0.5 on 64
    prompts differ by 3 standard errors when 26 points apart (3 * sqrt((0.594*0.406 +
    0.484*0.516) / 64) = 0.263); 11 points is noise."""
    assert accuracy_drop(38 / 64, 31 / 64, 64) == []


def test_a_collapse_on_a_small_held_out_set_is_reported():
    assert accuracy_drop(38 / 64, 7 / 64, 64) == [
        (10, "accuracy_falling")
    ]  # 59% -> 11%: 0.48 > 0.22


def test_a_drop_on_a_large_held_out_set_is_reported_with_its_noise():
    watchdog = Watchdog()
    key, size = "test/reverse/accuracy", "test/reverse/num_prompts"
    for row in [healthy(0) | {key: 0.60, size: 1000}, healthy(1) | {key: 0.45, size: 1000}]:
        found = watchdog.check(row)
    # 3 * sqrt((0.6*0.4 + 0.45*0.55) / 1000) = 0.066 < 0.15
    assert [s.message.split(":")[0] for s in found] == [
        "test/reverse/accuracy fell from 60.0% to 45.0%, beyond the noise of 1000 held-out prompts "
        "(±6.6%)"
    ]


def test_non_finite_values_are_skipped_not_read_as_symptoms():
    stream = [healthy(step) for step in range(8)]
    stream[3]["grad_norm"] = float("nan")
    stream[4]["entropy"] = float("inf")
    assert names(stream) == []


def test_stop_on_divergence_stops_the_run_with_the_symptom_and_keeps_the_last_checkpoint(
    base_config, tmp_path, capsys
):
    """A learning rate of 10 blows the tiny student up within its first steps."""
    import yaml

    base_config["training"] |= {"learning_rate": 10.0, "max_steps": 12, "max_grad_norm": None}
    base_config["save_every"] = 1
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(base_config))
    assert main(["train", str(config), "--no-progress"]) == 0
    warned = capsys.readouterr().err
    assert "opd: warning: step" in warned
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert len(rows) == 12  # warned, not stopped

    stopped = tmp_path / "stopped.yaml"
    stopped.write_text(
        yaml.safe_dump(base_config | {"log_path": str(tmp_path / "stopped")}).replace(
            "max_grad_norm: null", "max_grad_norm: null\n  stop_on_divergence: true"
        )
    )
    assert main(["train", str(stopped), "--no-progress"]) == 2
    error = capsys.readouterr().err
    assert "Stopped (training.stop_on_divergence)" in error and "Traceback" not in error
    done = read_jsonl(tmp_path / "stopped" / "metrics.jsonl")
    assert len(done) < 12
    first = warned.split("opd: warning: step ")[1].split(":")[0]
    assert done[-1]["step"] == int(first)


@pytest.mark.parametrize("value", ["yes please", 3])
def test_stop_on_divergence_takes_a_boolean(base_config, value):
    from opd.config import ConfigError, config_from_dict

    base_config["training"]["stop_on_divergence"] = value
    with pytest.raises(ConfigError, match=r"training\.stop_on_divergence"):
        config_from_dict(base_config)
