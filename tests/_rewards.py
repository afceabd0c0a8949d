"""Reward functions and group filters with slime's signatures, imported by dotted path
(``"_rewards.no_and"``) as slime's ``--custom-rm-path`` and ``--dynamic-sampling-filter-path``
import a user's module. ``tests/`` is on ``sys.path`` in the test sessions."""

from __future__ import annotations


async def no_and(args, sample, **kwargs):
    """1.0 for a response without the word "and", else 0.0 (an async slime custom RM)."""
    return float("and" not in sample.response.split())


async def odd_groups_score_nothing(args, sample, **kwargs):
    """:func:`no_and` for even prompt groups, 0.0 for odd ones: DAPO's filter drops every odd
    group (all its rewards equal), so a rollout batch of two groups needs a second round."""
    if sample.group_index % 2:
        return 0.0
    return await no_and(args, sample)


def response_lengths(args, samples, **kwargs):
    """A group reward (slime's ``--group-rm``): each response's length over the group's
    longest."""
    longest = max(s.response_length for s in samples)
    return [s.response_length / longest for s in samples]


def keep_first_group_only(args, samples, **kwargs):
    """A group filter returning a bare bool, as older slime filters do."""
    return samples[0].group_index == 0
