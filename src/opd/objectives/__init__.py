"""Advantages and losses: pure tensor functions, no I/O, no models."""
