"""Prompt sources, chat rendering and batching: everything before the student samples."""
