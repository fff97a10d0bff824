"""Objectives as components (one module each, registered by name) and the tensor math they use."""
