"""The out-of-the-box demo: a tiny teacher and a smaller student on a checkable task."""
