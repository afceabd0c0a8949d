"""slime's sample -> train-data step, on sample dicts (``Sample.to_dict()`` form).

What slime's ``RolloutManager._convert_samples_to_train_data`` hands the
trainer, for the fields that decide scheduling and loss normalisation
(``docs/reference_semantics.md`` section 6). The conversion itself lives in
the core (:func:`varbatch_kit.core.slime_dumps.slime_train_data`, which ``read_trace`` uses
for slime dumps); this adapter gives it slime's error type and wording.
Checked against slime's own conversion on recorded dumps
(``tests/golden/dumps/``).
"""

from __future__ import annotations

from typing import Any

from varbatch_kit.compat.slime.errors import SlimeCompatError
from varbatch_kit.core.slime_dumps import SlimeSampleError, slime_train_data

__all__ = ["convert_samples_to_train_data"]


def convert_samples_to_train_data(samples: list[Any], *, reward_key: str | None = None
                                  ) -> dict[str, list]:
    """slime's train-data fields for a batch of sample dicts.

    ``samples`` is a list of ``Sample.to_dict()`` dicts (a slime debug dump's
    ``"samples"``); nested lists (per prompt / per rollout, as compact rollout
    functions return them) are checked for slime's rollout-id contract and
    flattened, as slime does before conversion.

    Returns a dict with, per sample in (flattened) order:

    - ``total_lengths``: ``len(tokens)`` (slime computes it when splitting
      by DP rank);
    - ``response_lengths``: ``response_length``;
    - ``rollout_ids``: ``rollout_id`` when set, else a fresh id: the smallest
      non-negative integer no sample of the batch uses (explicit ids are
      reserved first), assigned in sample order;
    - ``loss_masks``: the mask as given, all ones when None, all zeros when
      ``remove_sample`` (the sample stays in the batch);
    - ``rollout_mask_sums``: the mask total of the sample's whole rollout;
    - ``truncated``: 1 when ``status == "truncated"``, else 0;
    - ``raw_reward``: the reward as given (``reward[reward_key]`` with a
      ``reward_key``); when any sample's ``metadata`` has ``"raw_reward"``,
      that value replaces it for those samples, as slime does;
    - ``sample_indices``: ``index``.

    Rewards are **raw**: slime's reward post-processing (e.g. GRPO group
    normalisation into ``rewards``) is not applied, and fields slime copies
    through unchanged (``tokens``, log-probs, multimodal inputs, ...) are not
    returned.

    Raises :class:`SlimeCompatError` (a ``ValueError`` and an
    ``AssertionError``) for a sample slime would reject, slime's wording
    first (``loss mask length 5 != response length 7: sample 3: ...``).
    """
    try:
        return slime_train_data(samples, reward_key=reward_key)
    except SlimeSampleError as e:
        raise SlimeCompatError(e.slime_style()) from None
