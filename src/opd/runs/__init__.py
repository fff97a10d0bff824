"""Everything a run leaves behind: metrics, examples, evaluations, saved students."""
