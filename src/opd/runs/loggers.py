"""Optional metric sinks beside ``metrics.jsonl``: TensorBoard, Weights & Biases, MLflow.

Each is used only when named in ``loggers`` and its package is installed; a missing package
is a config error before any training. Credentials are read by those libraries from the
environment (``WANDB_API_KEY``, ``MLFLOW_TRACKING_TOKEN``); opd never reads, logs or saves them.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path
from typing import Protocol

from opd.config import Config, ConfigError, recorded_config

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
EXTRAS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow-skinny"}


class MetricsLogger(Protocol):
    """Receives every metrics row."""

    def log(self, metrics: dict, step: int) -> None: ...

    def close(self) -> None: ...


def _numeric(metrics: dict) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in metrics.items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    }


class TensorBoardLogger:
    """Scalars under ``<log_path>/tensorboard``."""

    def __init__(self, log_path: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_path / "tensorboard"))

    def log(self, metrics: dict, step: int) -> None:
        for key, value in _numeric(metrics).items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """A W&B run (project ``wandb_project``, name ``run_name``); resumes the same id on restart."""

    def __init__(self, config: Config):
        import wandb

        log_path = Path(config.log_path)
        run_id_file = log_path / "wandb_run_id"
        run_id = (
            run_id_file.read_text().strip() if run_id_file.exists() else wandb.util.generate_id()
        )
        run_id_file.write_text(run_id)
        self.run = wandb.init(
            project=config.wandb_project,
            name=config.run_name,
            id=run_id,
            resume="allow",
            dir=str(log_path),
            config=recorded_config(config),
        )

    def log(self, metrics: dict, step: int) -> None:
        self.run.log(_numeric(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


MLFLOW_KEY = re.compile(r"[^\w\-./ ]")


class MlflowLogger:
    """An MLflow run in ``mlflow_tracking_uri``, else ``$MLFLOW_TRACKING_URI``, else
    ``<log_path>/mlruns``.

    The last is MLflow's file store, which MLflow 3 keeps in maintenance mode and only opens
    when ``MLFLOW_ALLOW_FILE_STORE`` is set: opd sets it for that fallback alone.
    """

    def __init__(self, config: Config):
        import mlflow

        self.mlflow = mlflow
        log_path = Path(config.log_path).resolve()
        if config.mlflow_tracking_uri:
            mlflow.set_tracking_uri(config.mlflow_tracking_uri)
        elif not os.environ.get("MLFLOW_TRACKING_URI"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri((log_path / "mlruns").as_uri())
        mlflow.set_experiment(config.run_name or log_path.name)
        self.run = mlflow.start_run(run_name=config.run_name or log_path.name)
        flat = _flatten(recorded_config(config))
        mlflow.log_params({k: str(v)[:500] for k, v in flat.items()})

    def log(self, metrics: dict, step: int) -> None:
        """Names use ``.`` for ``/`` (``teacher_kl.rev``): the file store cannot hold both a
        metric and a folder called ``teacher_kl``."""
        clean = {
            MLFLOW_KEY.sub("_", k.replace("@", "_at_").replace("/", ".")): v
            for k, v in _numeric(metrics).items()
        }
        self.mlflow.log_metrics(clean, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


def _flatten(data: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat |= _flatten(value, f"{prefix}{key}.")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                flat |= (
                    _flatten(item, f"{prefix}{key}.{i}.")
                    if isinstance(item, dict)
                    else {f"{prefix}{key}.{i}": item}
                )
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def check_loggers(config: Config) -> None:
    """Fail before training when a named logger's package is missing."""
    for name in config.loggers:
        if importlib.util.find_spec(PACKAGES[name]) is None:
            raise ConfigError(
                f"loggers: '{name}' needs the {PACKAGES[name]} package, which is not installed; "
                f"pip install {EXTRAS[name]}   (or remove '{name}' from loggers)"
            )
    if "wandb" in config.loggers and not config.wandb_project:
        raise ConfigError("wandb_project: required when loggers include 'wandb'")


def build_loggers(config: Config) -> list[MetricsLogger]:
    """The configured loggers, opened."""
    check_loggers(config)
    log_path = Path(config.log_path)
    factories = {
        "tensorboard": lambda: TensorBoardLogger(log_path),
        "wandb": lambda: WandbLogger(config),
        "mlflow": lambda: MlflowLogger(config),
    }
    return [factories[name]() for name in config.loggers]
