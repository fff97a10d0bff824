"""What is done with a run's saved checkpoints once they exist: evaluate one on its held-out
sets (``opd eval``, :mod:`~opd.saved.evaluate`) and export it as a model others load
(``opd export``, :mod:`~opd.saved.export`). Both assemble their parts as training does."""
