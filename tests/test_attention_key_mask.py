"""``lite_boost.ops.attention(..., key_mask=)``: key-padding masks in the dense dispatch."""

import math

import pytest
import torch

from lite_boost.ops.attention import BACKENDS, AttentionBackendError, attention, available_backends, select_backend


def _reference(q, k, v, key_mask):
    """float64 softmax attention (B, S, H, D) with masked keys excluded, no lite_boost code."""
    logits = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) / math.sqrt(q.shape[-1])
    logits = logits.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", logits.softmax(-1), v.double())


@pytest.mark.parametrize("layout", ["BSND", "BNSD"])
def test_key_mask_excludes_padded_keys(layout):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 9, 3, 8, generator=g) for _ in range(3))
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[0, 6:] = False
    mask[1, [1, 4]] = False  # not a suffix
    k = k.masked_fill(~mask[..., None, None], 1e4)  # masked keys would dominate if attended
    ref = _reference(q, k, v, mask)
    args = (q, k, v) if layout == "BSND" else tuple(t.transpose(1, 2) for t in (q, k, v))
    out = attention(*args, layout=layout, key_mask=mask)
    out = out if layout == "BSND" else out.transpose(1, 2)
    assert (out.double() - ref).abs().max() < 1e-5
    assert (attention(q, k, v, key_mask=torch.ones_like(mask)) - attention(q, k, v)).abs().max() < 1e-6


def test_backends_declare_mask_support_and_a_forced_one_says_so():
    assert [n for n, b in BACKENDS.items() if b.supports_key_mask] == ["sdpa"]
    assert BACKENDS["fa2"].rejects("cuda", torch.float16, 64, 8, False, masked=True) == \
        "no key-padding mask support (key_mask given)"
    assert available_backends("cpu", masked=True)["sdpa"] is None
    q = torch.randn(1, 4, 2, 8)
    mask = torch.ones(1, 4, dtype=torch.bool)
    assert select_backend(q, masked=True) == "sdpa"
    with pytest.raises(AttentionBackendError, match=r"'fa3' \(requested by the call\) is unavailable for "
                                                    r"cpu/float32/head_dim=8/heads=2/key_mask: .*Usable backends "
                                                    r"for this call: \['sdpa'\]"):
        attention(q, q, q, backend="fa3", key_mask=mask)


def test_bad_key_masks_name_the_argument():
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(TypeError, match="key_mask must be a bool tensor"):
        attention(q, q, q, key_mask=torch.ones(1, 4))
    with pytest.raises(ValueError, match=r"key_mask must have shape \(B, S_k\) = \(1, 4\)"):
        attention(q, q, q, key_mask=torch.ones(1, 5, dtype=torch.bool))


def test_key_mask_compiles_without_a_graph_break():
    torch._dynamo.reset()

    def fn(q, k, v, mask):
        return attention(q, k, v, key_mask=mask) * 2

    q = torch.randn(1, 6, 2, 8)
    mask = torch.tensor([[True] * 4 + [False] * 2])
    report = torch._dynamo.explain(fn)(q, q, q, mask)
    assert report.graph_break_count == 0, [r.reason for r in report.break_reasons]
    torch._dynamo.reset()
