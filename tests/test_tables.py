"""Prompts from Hugging Face ``datasets`` tables, written by ``datasets`` itself: a ``save_to_disk``
directory with train and test splits, a Parquet file of chat messages; the columns mapped by
``fields``; a missing column named with the columns there are; a hub id without the hub named
with the fix."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml
from datasets import Dataset, DatasetDict

from opd.cli import main
from opd.config import ConfigError, config_from_dict
from opd.trainer.loop import Trainer, train

WORDS = {"train": ["abc", "hgf", "dcea", "bbad"], "test": ["gah", "fed"]}


@pytest.fixture
def saved(tmp_path):
    """A DatasetDict as a user's would be: a question column, an integer id, the answer."""
    splits = {
        split: Dataset.from_dict(
            {
                "question": [f"reverse {w}" for w in words],
                "id": list(range(len(words))),
                "solution": [w[::-1] for w in words],
            }
        )
        for split, words in WORDS.items()
    }
    path = tmp_path / "saved"
    DatasetDict(splits).save_to_disk(str(path))
    return path


def test_a_saved_dataset_with_its_columns_mapped_trains_and_evaluates_on_its_test_split(
    base_config, saved
):
    base_config["datasets"][0] |= {
        "source": str(saved),
        "fields": {"prompt": "question", "answer": "solution"},
        "eval_split": "test",
    }
    config = config_from_dict(base_config)
    trainer = Trainer(config, progress=False)
    train_prompts = trainer.parts.datasets[0]
    assert [p.messages for p in train_prompts] == [
        ({"role": "user", "content": f"reverse {w}"},) for w in WORDS["train"]
    ]
    assert [p.answer for p in train_prompts] == [w[::-1] for w in WORDS["train"]]
    (eval_set,) = trainer.parts.eval_sets
    assert [p.answer for p in eval_set.prompts] == ["hag", "def"]
    rows = train(config, progress=False).metrics
    assert rows[-1]["test/rev/num_prompts"] == 2 and "test/rev/accuracy" in rows[-1]


def test_a_parquet_file_of_chat_messages(base_config, tmp_path):
    path = tmp_path / "chats.parquet"
    messages = [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"reverse {w}"}]
        for w in WORDS["train"]
    ]
    Dataset.from_dict(
        {"messages": messages, "answer": [w[::-1] for w in WORDS["train"]]}
    ).to_parquet(str(path))
    base_config["datasets"][0] |= {"source": str(path), "num_prompts": 3}
    prompts = Trainer(config_from_dict(base_config), progress=False).parts.datasets[0]
    assert [p.messages[-1]["content"] for p in prompts] == [
        "reverse abc",
        "reverse hgf",
        "reverse dcea",
    ]
    assert prompts[0].messages[0] == {"role": "system", "content": "Be brief."}


def test_a_column_that_is_not_there_is_named_with_those_that_are(
    base_config, saved, tmp_path, capsys
):
    base_config["datasets"][0] |= {"source": str(saved), "fields": {"prompt": "questoin"}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(base_config))
    assert main(["train", str(path)]) == 2
    error = capsys.readouterr().err
    assert (
        f"{saved} (split 'train'): fields.prompt: no column 'questoin'; its columns: question, id, "
        "solution" in error
    )
    assert "Traceback" not in error


def test_table_options_on_a_jsonl_file_or_an_unknown_key_are_refused(base_config):
    base_config["datasets"][0] |= {"fields": {"prompt": "question"}}
    with pytest.raises(ConfigError, match=r"datasets\[0\]\.fields: applies to tables"):
        config_from_dict(base_config)
    base_config["datasets"][0] |= {"source": "hf:someone/data", "fields": {"question": "q"}}
    with pytest.raises(
        ConfigError,
        match=r"datasets\[0\]\.fields\.question: not a prompt key; use prompt, messages",
    ):
        config_from_dict(base_config)


def test_a_hub_dataset_without_the_hub_is_named_with_the_fix(base_config, tmp_path):
    base_config["datasets"][0] |= {
        "source": "hf:someone/not-cached",
        "fields": {"prompt": "question"},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(base_config))
    env = os.environ | {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(tmp_path / "cache"),
        "OMP_NUM_THREADS": "1",
    }
    done = subprocess.run(
        [sys.executable, "-m", "opd", "train", str(path), "--no-progress"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("opd: error: hf:someone/not-cached (split 'train'): cannot load it:")
    assert last.endswith(
        "(without network: a local directory or Parquet file, or HF_HUB_OFFLINE=1 with it cached)"
    )
