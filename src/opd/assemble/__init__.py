"""A run's parts assembled from its config, shared by training, ``opd eval`` and ``opd export``:
the student (:mod:`~opd.assemble.student`), the teachers (:mod:`~opd.assemble.teachers`) and
the held-out sets (:mod:`~opd.assemble.eval_sets`)."""
