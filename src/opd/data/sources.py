"""The prompt source a config names, of every kind: JSONL files, built-in and reasoning-gym tasks,
tables. The one module that knows them all, so that each of them imports only the records
(``opd.data.prompts``) and none imports another."""

from __future__ import annotations

from typing import Any

from opd.data.builtin_tasks import DEFAULT_NUM_PROMPTS, generate_task_prompts
from opd.data.prompts import Prompt, load_jsonl_prompts, reasoning_gym_prompts
from opd.data.tables import TableOptions, is_table_source, load_table_prompts


def load_prompts(
    source: str,
    *,
    seed: int = 0,
    count: int | None = None,
    task_config: dict[str, Any] | None = None,
    table: TableOptions | None = None,
) -> list[Prompt]:
    """Load a source: a JSONL path, ``demo:<task>`` or ``reasoning_gym:<task>`` (generated,
    ``@test`` split), or a table (``hf:<dataset>``, a ``save_to_disk`` directory, a Parquet file:
    ``table`` says which split and columns).

    ``count`` is how many prompts a generated source makes (default 2000), or how many rows of a
    table are read (default all).
    """
    if is_table_source(source):
        return load_table_prompts(source, table or TableOptions(), count)
    if source.startswith("demo:"):
        return generate_task_prompts(
            source.removeprefix("demo:"), seed=seed, count=count or DEFAULT_NUM_PROMPTS
        )
    if source.startswith("reasoning_gym:"):
        return reasoning_gym_prompts(
            source.removeprefix("reasoning_gym:"),
            seed=seed,
            count=count or 2000,
            task_config=task_config or {},
        )
    return load_jsonl_prompts(source)
