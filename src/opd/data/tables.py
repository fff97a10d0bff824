"""Prompts from tables: a Hugging Face ``datasets`` hub id (``hf:<owner>/<name>``, streamed, so
a large dataset is read only as far as the run needs), a directory written by
``Dataset.save_to_disk``, or a Parquet file; each row mapped to a prompt through ``fields``."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

from opd.data.prompts import Prompt, parse_prompt_record
from opd.errors import DataError

HUB_PREFIX = "hf:"
PROMPT_KEYS = ("prompt", "messages", "answer", "completion", "metadata")
"""What a row can give a prompt (as in a JSONL prompt file)."""


@dataclass(frozen=True)
class TableOptions:
    """Which part of a table, and which of its columns are what."""

    split: str = "train"
    subset: str | None = None
    fields: dict[str, str] = field(default_factory=dict)


def is_table_source(source: str) -> bool:
    """A hub dataset, a ``save_to_disk`` directory or a Parquet file (not a JSONL prompt file)."""
    path = Path(source).expanduser()
    if source.startswith(HUB_PREFIX) or path.suffix == ".parquet":
        return True
    try:
        return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()
    except (OSError, ValueError):  # a name no file can have (too long, a NUL byte): no table
        return False


def _open(source: str, options: TableOptions):
    """The rows of ``options.split`` of ``source`` (an iterable dataset for the hub), and its
    columns."""
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"{source}: reading datasets needs the datasets package: pip install 'opd[datasets]'"
        ) from None
    where = f"{source} (split {options.split!r})"
    try:
        if source.startswith(HUB_PREFIX):
            table = datasets.load_dataset(
                source.removeprefix(HUB_PREFIX), options.subset, split=options.split, streaming=True
            )
        elif Path(source).expanduser().suffix == ".parquet":
            table = datasets.load_dataset(
                "parquet",
                data_files={options.split: str(Path(source).expanduser())},
                split=options.split,
            )
        else:
            table = datasets.load_from_disk(str(Path(source).expanduser()))
            if isinstance(table, datasets.DatasetDict):
                if options.split not in table:
                    raise DataError(f"{where}: no such split; it has {sorted(table)}")
                table = table[options.split]
    except DataError:
        raise
    except Exception as error:  # datasets raises many kinds; each means a source it cannot read
        offline = (
            " (without network: a local directory or Parquet file, or HF_HUB_OFFLINE=1 with it "
            "cached)"
        )
        hint = offline if source.startswith(HUB_PREFIX) else ""
        raise DataError(f"{where}: cannot load it: {type(error).__name__}: {error}{hint}") from None
    columns = list(table.column_names or table.features or [])
    return table, columns, where


def load_table_prompts(source: str, options: TableOptions, count: int | None) -> list[Prompt]:
    """The first ``count`` rows (all when None) of the table as prompts; a mapped column the table
    lacks, or a table with neither a prompt nor messages, is named with the columns it has."""
    for key in options.fields:
        if key not in PROMPT_KEYS:
            raise DataError(f"fields.{key}: not a prompt key; use {', '.join(PROMPT_KEYS)}")
    table, columns, where = _open(source, options)
    column_of = {key: options.fields.get(key, key) for key in PROMPT_KEYS}
    for key, column in options.fields.items():
        if column not in columns:
            raise DataError(
                f"{where}: fields.{key}: no column {column!r}; its columns: {', '.join(columns)}"
            )
    if column_of["prompt"] not in columns and column_of["messages"] not in columns:
        raise DataError(
            f"{where}: no 'prompt' or 'messages' column; its columns: {', '.join(columns)}. Map "
            "one in "
            "fields (e.g. fields: {prompt: question, answer: answer})"
        )
    prompts = []
    for index, row in enumerate(islice(table, count)):
        record = {key: row[column] for key, column in column_of.items() if column in row}
        prompts.append(parse_prompt_record(record, f"{where} row {index}"))
    if not prompts:
        raise DataError(f"{where}: no rows")
    return prompts
