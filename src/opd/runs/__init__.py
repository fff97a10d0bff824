"""Everything a run leaves behind and reads back: checkpoints, metrics, examples, evaluations,
the report."""
