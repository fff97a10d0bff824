"""A run's parts built from its config, shared by training, ``opd eval`` and ``opd export``: the
student (:mod:`~opd.build.student`), the teachers (:mod:`~opd.build.teachers`) and the held-out
sets (:mod:`~opd.build.eval_sets`)."""
