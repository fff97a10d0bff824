"""Environments: multi-turn episodes that start from a dataset's prompt and answer each of the
student's turns (a tool's result, a user's reply) until they end, with a reward.

An environment is a registered component, like an objective: a subclass of
:class:`opd.envs.base.Environment` with a ``name`` in a module of this package, or any class
given by import path (``env: {name: my_pkg.envs:MyEnv}``). :mod:`opd.sampling.episodes` plays
the episodes with whichever engine samples the student.
"""
