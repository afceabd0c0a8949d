"""Zigzag CP slicing: hand-derived ranges, exact tiling, slicing of tensors, bad input."""

import numpy as np
import pytest
import torch

from varbatch_kit.report.cp import (
    cp_local_response_length,
    cp_local_response_lengths,
    slice_flat_responses_for_cp,
    slice_response_for_cp,
    validate_cp,
    zigzag_chunk_size,
    zigzag_slice,
)


@pytest.mark.parametrize(
    ("total", "cp", "chunk"), [(12, 1, 6), (12, 2, 3), (12, 4, 2), (5, 2, 2), (1, 4, 1), (17, 3, 3)]
)
def test_chunk_size_is_ceil_of_total_over_two_cp(total, cp, chunk):
    assert zigzag_chunk_size(total, cp) == chunk


def test_hand_derived_slices_cp2():
    # T=12, R=8, P=4, chunks of 3. Logits that predict the response: [3, 11).
    s0 = zigzag_slice(12, 8, cp_rank=0, cp_size=2)
    assert s0.chunk_size == 3
    assert s0.chunks == ((0, 3), (9, 12))
    assert s0.logits_ranges == ((0, 0), (9, 11))  # chunk 0 holds no response logit
    assert s0.token_ranges == ((0, 0), (10, 12))
    assert s0.response_ranges == ((0, 0), (6, 8))
    assert s0.local_response_length == 2
    s1 = zigzag_slice(12, 8, cp_rank=1, cp_size=2)
    assert s1.chunks == ((3, 6), (6, 9))
    assert s1.logits_ranges == ((3, 6), (6, 9))
    assert s1.token_ranges == ((4, 7), (7, 10))
    assert s1.response_ranges == ((0, 3), (3, 6))
    assert s1.prompt_length == 4


def test_hand_derived_slices_cp4():
    # T=12, R=8, chunks of 2; rank r owns chunks r and 7-r.
    ranges = [zigzag_slice(12, 8, cp_rank=r, cp_size=4).response_ranges for r in range(4)]
    assert ranges == [
        ((0, 0), (0, 0)),  # chunks [0,2) and [14,16): no logit in [3, 11)
        ((0, 1), (0, 0)),  # logits [3,4) -> token 4 -> response 0
        ((1, 3), (7, 8)),  # logits [4,6) and [10,11)
        ((3, 5), (5, 7)),  # logits [6,8) and [8,10)
    ]
    assert [cp_local_response_length(12, 8, cp_rank=r, cp_size=4) for r in range(4)] == [0, 1, 3, 4]


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_response_pieces_tile_the_response_exactly_once(cp):
    for total in range(1, 30):
        for response in range(total):  # a prompt of >= 1 token
            covered = np.zeros(response, dtype=int)
            for r in range(cp):
                for a, b in zigzag_slice(total, response, cp_rank=r, cp_size=cp).response_ranges:
                    covered[a:b] += 1
            assert (covered == 1).all(), (total, response, cp, covered)


def test_slice_response_takes_the_two_pieces_in_order():
    values = torch.arange(8.0)
    assert slice_response_for_cp(values, 12, cp_rank=0, cp_size=2).tolist() == [6.0, 7.0]
    assert slice_response_for_cp(values, 12, cp_rank=1, cp_size=2).tolist() == [0, 1, 2, 3, 4, 5]
    assert slice_response_for_cp(values, 12, cp_rank=2, cp_size=4).tolist() == [1.0, 2.0, 7.0]
    assert slice_response_for_cp(values, 12, cp_rank=0, cp_size=1) is values


def test_slice_keeps_gradient_flow():
    values = torch.arange(8.0, requires_grad=True)
    slice_response_for_cp(values, 12, cp_rank=3, cp_size=4).sum().backward()
    assert values.grad.tolist() == [0, 0, 0, 1, 1, 1, 1, 0]


def test_flat_slicing_matches_per_sample_slicing():
    totals, responses = [12, 5, 7], [8, 3, 0]
    flat = torch.arange(11.0)
    for r in range(3):
        local = slice_flat_responses_for_cp(flat, totals, responses, cp_rank=r, cp_size=3)
        pieces = flat.split(responses)
        expected = torch.cat(
            [slice_response_for_cp(p, t, cp_rank=r, cp_size=3) for p, t in zip(pieces, totals)]
        )
        assert torch.equal(local, expected)
        lengths = cp_local_response_lengths(totals, responses, cp_rank=r, cp_size=3)
        assert sum(lengths) == local.shape[0]


def test_numpy_and_tensor_integers_are_accepted():
    s = zigzag_slice(np.int64(12), torch.tensor(8), cp_rank=np.int32(1), cp_size=2)
    assert s.response_ranges == ((0, 3), (3, 6))
    assert validate_cp(np.int64(0), np.int64(2)) == (0, 2)


@pytest.mark.parametrize(("cp_rank", "cp_size"), [(-1, 2), (2, 2), (5, 4), (0, 0), (0, -1)])
def test_cp_rank_outside_range_is_a_value_error(cp_rank, cp_size):
    with pytest.raises(ValueError, match=r"cp_rank=|cp_size="):
        zigzag_slice(12, 8, cp_rank=cp_rank, cp_size=cp_size)


def test_cp_rank_message_says_what_would_work():
    with pytest.raises(ValueError, match=r"cp_rank=3 is outside \[0, cp_size\) = \[0, 3\).*0\.\.2"):
        validate_cp(3, 3)


def test_response_longer_than_total_is_a_value_error():
    with pytest.raises(ValueError, match=r"response_length=9 > total_length=8"):
        zigzag_slice(8, 9, cp_rank=0, cp_size=2)
    with pytest.raises(ValueError, match=r"response_length=9 > total_length=8"):
        slice_response_for_cp(torch.zeros(9), 8, cp_rank=0, cp_size=1)
    with pytest.raises(ValueError, match=r"response_length=9 > total_length=8"):
        cp_local_response_length(8, 9, cp_rank=0, cp_size=1)


def test_response_without_prompt_is_a_value_error_under_cp():
    with pytest.raises(ValueError, match=r"no prompt.*total_length >= response_length \+ 1"):
        zigzag_slice(8, 8, cp_rank=0, cp_size=2)


def test_flat_length_mismatch_is_a_value_error():
    with pytest.raises(ValueError, match=r"flat_values has length 10 but sum\(response_lengths\)"):
        slice_flat_responses_for_cp(torch.zeros(10), [12, 5], [8, 3], cp_rank=0, cp_size=2)


def test_non_integer_lengths_are_value_errors():
    with pytest.raises(ValueError, match=r"total_length=12.5 is not an integer"):
        zigzag_slice(12.5, 8, cp_rank=0, cp_size=2)
    with pytest.raises(ValueError, match=r"cp_size=True is not an integer"):
        validate_cp(0, True)


# the edges below are where a mutation run of report/ (one operator or constant changed at
# a time) found no failing test: each test fails on its mutant


def test_a_zero_cp_size_is_named_in_the_message():
    with pytest.raises(ValueError, match=r"cp_size=0 is invalid; it must be an integer >= 1"):
        validate_cp(0, 0)


def test_an_empty_sequence_is_a_value_error():
    with pytest.raises(ValueError, match=r"total_length=0 is invalid"):
        zigzag_chunk_size(0, 2)
    with pytest.raises(ValueError, match=r"total_length=0 is invalid"):
        zigzag_slice(0, 0, cp_rank=0, cp_size=2)


def test_a_one_token_response_without_prompt_is_a_value_error_under_cp():
    with pytest.raises(ValueError, match=r"no prompt"):
        zigzag_slice(1, 1, cp_rank=0, cp_size=2)
    assert zigzag_slice(1, 0, cp_rank=0, cp_size=2).response_ranges == ((0, 0), (0, 0))


@pytest.mark.parametrize("cp_size", [1, 2])
def test_no_samples_slice_to_an_empty_tensor(cp_size):
    for ranks, sizes in ((0, cp_size), ([], [])):
        out = slice_flat_responses_for_cp(torch.zeros(0), [], [], cp_rank=ranks, cp_size=sizes)
        assert out.shape == (0,)


def test_per_sample_degrees_as_tensors_or_arrays_equal_lists():
    # sample 0 (T=12, R=8) on rank 1 of 2: chunks [3, 9), response tokens 0-5 (6 of them);
    # sample 1 (T=5, R=3) alone (degree 1): its 3
    lists = cp_local_response_lengths([12, 5], [8, 3], cp_rank=[1, 0], cp_size=[2, 1])
    tensors = cp_local_response_lengths([12, 5], [8, 3], cp_rank=torch.tensor([1, 0]),
                                        cp_size=torch.tensor([2, 1]))
    arrays = cp_local_response_lengths([12, 5], [8, 3], cp_rank=np.array([1, 0]),
                                       cp_size=np.array([2, 1]))
    assert lists == tensors == arrays == [6, 3]
    flat = torch.arange(11.0)
    a = slice_flat_responses_for_cp(flat, [12, 5], [8, 3], cp_rank=[1, 0], cp_size=[2, 1])
    b = slice_flat_responses_for_cp(flat, [12, 5], [8, 3], cp_rank=torch.tensor([1, 0]),
                                    cp_size=torch.tensor([2, 1]))
    assert torch.equal(a, b) and a.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 8.0, 9.0, 10.0]
