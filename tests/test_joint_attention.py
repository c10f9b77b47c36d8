"""Joint (image + text) attention: the single-device composition and Ulysses with replicated text.

The reference is softmax attention over the concatenated [text, image] / [image, text] sequence in
float64 with padded text keys excluded, computed without any lite_boost code.
"""

import pytest
import torch

import _dist_joint_cases as cases
from _dist_utils import run_ranks
from lite_boost.ops.joint import JointTokens, concat_joint, joint_attention, split_joint

TOL = 1e-5


@pytest.mark.parametrize("first", [True, False])
@pytest.mark.parametrize("masked", [False, True])
def test_joint_attention_matches_concatenated_reference(first, masked):
    (q, k, v), joint = cases.make_case(3, 2, 11, 6, 3, 8, masked, first)
    out, joint_out = joint_attention(cases.sdpa_kernel, q, k, v, joint)
    ref, ref_joint = cases.reference(q, k, v, joint.q, joint.k, joint.v, joint.key_mask, first)
    assert out.shape == q.shape and joint_out.shape == joint.q.shape
    assert (out.double() - ref).abs().max() < TOL
    assert (joint_out.double() - ref_joint).abs().max() < TOL


@pytest.mark.parametrize("first", [True, False])
@pytest.mark.parametrize("masked", [False, True])
def test_keys_only_joint_stream_gives_the_main_output(first, masked):
    """A joint stream without queries is attended as keys only: the main rows are those of the full joint
    attention, and there are no joint rows."""
    (q, k, v), joint = cases.make_case(5, 2, 9, 4, 3, 8, masked, first)
    only = cases.keys_only(joint)
    assert only.keys_only and not joint.keys_only
    out, joint_out = joint_attention(cases.sdpa_kernel, q, k, v, only)
    ref, _ = cases.reference(q, k, v, joint.q, joint.k, joint.v, joint.key_mask, first)
    assert joint_out.shape == (2, 0, 3, 8)
    assert (out.double() - ref).abs().max() < TOL
    with pytest.raises(ValueError, match="keys only"):
        JointTokens(joint.q[:, :2], joint.k, joint.v).check(q, v)


def test_joint_attention_without_joint_is_plain_attention():
    (q, k, v), _ = cases.make_case(0, 1, 7, 2, 2, 8, False, True)
    assert torch.equal(joint_attention(cases.sdpa_kernel, q, k, v), cases.sdpa_kernel(q, k, v))


def test_concat_and_split_are_inverse():
    (q, k, v), joint = cases.make_case(1, 2, 5, 3, 2, 4, True, False)
    qa, ka, va, mask = concat_joint(q, k, v, joint)
    assert qa.shape[1] == 8 and mask.shape == (2, 8) and mask[:, :5].all() and torch.equal(mask[:, 5:], joint.key_mask)
    main, extra = split_joint(qa, joint, 5)
    assert torch.equal(main, q) and torch.equal(extra, joint.q)


def test_joint_heads_slice_and_checks():
    (q, k, v), joint = cases.make_case(2, 1, 5, 3, 4, 8, True, True)
    part = joint.heads(1, 3)
    assert part.q.shape == (1, 3, 2, 8) and part.key_mask is joint.key_mask and part.first
    with pytest.raises(ValueError, match="joint.q must be"):
        joint.heads(0, 2).check(q, v)
    with pytest.raises(ValueError, match="key_mask"):
        JointTokens(joint.q, joint.k, joint.v, joint.key_mask.float()).check(q, v)


def test_duplicated_text_keys_would_bias_the_softmax():
    """Why the replicated text must not go through the all_to_all: P copies of each text key shift the result."""
    (q, k, v), joint = cases.make_case(4, 1, 8, 4, 2, 8, False, True)
    ref, _ = cases.reference(q, k, v, joint.q, joint.k, joint.v, None, True)
    dup = JointTokens(joint.q, joint.k.repeat(1, 2, 1, 1), joint.v.repeat(1, 2, 1, 1))
    biased = cases.sdpa_kernel(q, torch.cat([dup.k, k], 1), torch.cat([dup.v, v], 1))
    assert (biased.double() - ref).abs().max() > 1e-2


@pytest.fixture(scope="module", params=[2, 3])
def dist_results(request):
    return request.param, run_ranks(cases.joint_cases, request.param, timeout=240)


@pytest.mark.slow
@pytest.mark.parametrize("name", [c[0] for c in cases.JOINT_SHAPES])
def test_ulysses_joint_attention_equals_one_process(dist_results, name):
    world, results = dist_results
    T, H = next(c for c in cases.JOINT_SHAPES if c[0] == name)[3:5]
    for r, res in enumerate(results):
        c = res[name]
        assert c["image_err"] < TOL, (world, r, c)
        assert c["joint_err"] < TOL, (world, r, c)
        assert c["joint_shape"][1:3] == (T, H)
        assert c["a2a_sent"] == c["a2a_expected"], (world, r, c)  # the text never enters the all_to_all
        assert c["joint_gather_calls"] == 1
    assert len({res[name]["joint_bytes"] for res in results}) == 1  # text output identical on every rank


@pytest.mark.slow
@pytest.mark.parametrize("name", [c[0] for c in cases.JOINT_SHAPES])
def test_ulysses_keys_only_joint_stream(dist_results, name):
    """Keys-only joint tokens through Ulysses: the image rows equal one process, no joint rows, no gather."""
    world, results = dist_results
    for r, res in enumerate(results):
        c = res[name + ":keys_only"]
        assert c["image_err"] < TOL, (world, r, c)
        assert c["joint_shape"][1] == 0 and c["joint_gather_calls"] == 0, (world, r, c)
