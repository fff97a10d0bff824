"""Optional loggers: TensorBoard and MLflow for real, a missing package refused before training,
and no secret in anything a run writes."""

import importlib.util

import pytest

from opd.config import ConfigError, config_from_dict
from opd.trainer.loop import Trainer, train


def test_tensorboard_and_mlflow_receive_every_step(base_config, tmp_path):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = dict(base_config, loggers=["tensorboard", "mlflow"], run_name="tiny")
    train(config_from_dict(config), progress=False)
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("teacher_kl")] == [0, 1]
    client = MlflowClient(tracking_uri=(tmp_path / "run" / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    assert [m.step for m in client.get_metric_history(run.info.run_id, "teacher_kl")] == [0, 1]
    assert len(client.get_metric_history(run.info.run_id, "teacher_kl.rev")) == 2
    assert run.data.params["training.learning_rate"] == "0.001"


@pytest.mark.skipif(
    importlib.util.find_spec("wandb") is not None, reason="checks the error when wandb is absent"
)
def test_missing_logger_package_is_refused_before_training(base_config, tmp_path):
    config = dict(base_config, loggers=["wandb"], wandb_project="p")
    with pytest.raises(
        ConfigError, match=r"loggers: 'wandb' needs the wandb package.*pip install wandb"
    ):
        Trainer(config_from_dict(config), progress=False)
    assert not (tmp_path / "run").exists()


def test_unknown_logger_is_a_config_error(base_config):
    with pytest.raises(
        ConfigError, match=r"loggers\[0\]: 'tensorbord' is not one of .*did you mean 'tensorboard'"
    ):
        config_from_dict(dict(base_config, loggers=["tensorbord"]))


def test_secrets_in_the_environment_never_reach_run_files(base_config, tmp_path, monkeypatch):
    secret = "sk-test-0123456789abcdef"
    for name in ("WANDB_API_KEY", "MLFLOW_TRACKING_TOKEN", "HF_TOKEN", "OPENAI_API_KEY"):
        monkeypatch.setenv(name, secret)
    train(
        config_from_dict(dict(base_config, loggers=["tensorboard", "mlflow"], trace=True)),
        progress=False,
    )
    for path in (tmp_path / "run").rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path
