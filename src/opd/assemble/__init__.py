"""The one place a run is put together from its config: :func:`~opd.assemble.run.assemble_run`
builds every part of a training run (:class:`~opd.assemble.run.RunComponents`); ``opd eval`` and
``opd export`` assemble the student (:mod:`~opd.assemble.student`), the teachers
(:mod:`~opd.assemble.teachers`) and the held-out sets (:mod:`~opd.assemble.eval_sets`) the same
way."""
