"""The training loop: sample, score, compute advantages, update."""
