"""Scheduling algorithms on plain arrays: Karmarkar-Karp, packers, distributions, balancing.

The bottom layer: numpy in, bins out; nothing here knows a ``Rollouts`` or
a ``Schedule``. :mod:`~varbatch_kit.policies.registry` assembles the names
users choose.
"""
