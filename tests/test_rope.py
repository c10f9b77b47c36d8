import pytest
import torch
from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

from lite_boost.ops.rope import RopeCache, apply_rotary_emb, axis_dims, rope_tables, rotate


def diffusers_rotation(hidden_states, freqs_cos, freqs_sin):
    """The rotation of diffusers' WanAttnProcessor (transcribed as the reference)."""
    x1, x2 = hidden_states.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(hidden_states)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(hidden_states)


def stock_tables(grid, head_dim, patch=(1, 2, 2)):
    rope = WanRotaryPosEmbed(head_dim, patch, 1024)
    lat = torch.zeros(1, 1, grid[0] * patch[0], grid[1] * patch[1], grid[2] * patch[2])
    return rope(lat)


@pytest.mark.parametrize("grid, head_dim", [((3, 5, 7), 24), ((2, 4, 6), 48), ((1, 3, 2), 128), ((4, 1, 1), 12)])
def test_tables_and_rotation_match_diffusers_fp32(grid, head_dim):
    cos, sin = stock_tables(grid, head_dim)
    x = torch.randn(2, cos.shape[1], 3, head_dim)
    ref = diffusers_rotation(x, cos, sin)
    ours = rope_tables(grid, head_dim)
    assert ours.freqs.shape == (1, cos.shape[1], 1, head_dim // 2)
    assert (rotate(x, ours.freqs) - ref).abs().max().item() <= 1e-6
    assert (apply_rotary_emb(x, cos, sin) - ref).abs().max().item() <= 1e-6
    # in place gives the same numbers and really overwrites its input
    y = x.clone()
    out = rotate(y, ours.freqs, inplace=True)
    assert out.data_ptr() == y.data_ptr()
    assert (y - ref).abs().max().item() <= 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_fp32_math_rounded_once(dtype):
    grid, d = (2, 3, 4), 24
    cos, sin = stock_tables(grid, d)
    x = torch.randn(1, 24, 2, d).to(dtype)
    ref = diffusers_rotation(x, cos, sin)  # diffusers: fp32 products, one rounding on the write
    out = rotate(x, rope_tables(grid, d).freqs)
    assert out.dtype == dtype
    assert torch.equal(out, ref) or (out.float() - ref.float()).abs().max() <= torch.finfo(dtype).eps * 4
    # non-contiguous input (a transposed view) through the chunked in-place path
    xt = x.transpose(0, 0).clone().transpose(1, 2).contiguous().transpose(1, 2)
    assert not xt.is_contiguous()
    rotate(xt, rope_tables(grid, d).freqs, inplace=True)
    torch.testing.assert_close(xt.float(), ref.float(), atol=float(torch.finfo(dtype).eps) * 4, rtol=0)


def test_chunked_path_covers_long_sequences(monkeypatch):
    import lite_boost.ops.rope as R

    monkeypatch.setattr(R, "_CHUNK_BYTES", 4 * 3 * 2 * 24 * 5)  # 5 tokens per chunk
    grid, d = (3, 4, 5), 24
    cos, sin = stock_tables(grid, d)
    x = torch.randn(3, 60, 2, d).to(torch.bfloat16)
    ref = diffusers_rotation(x, cos, sin)
    torch.testing.assert_close(rotate(x, rope_tables(grid, d).freqs).float(), ref.float(), atol=1e-2, rtol=0)


def test_slices_and_padding_rows():
    grid, d = (2, 3, 5), 24
    full = rope_tables(grid, d).freqs
    part = rope_tables(grid, d, start=7, stop=19)
    assert (part.start, part.stop, part.seq_len) == (7, 19, 30)
    assert torch.equal(part.freqs, full[:, 7:19])
    padded = rope_tables(grid, d, start=24, stop=36).freqs
    assert torch.equal(padded[:, :6], full[:, 24:30])
    assert torch.equal(padded[:, 6:], torch.ones_like(padded[:, 6:]))  # identity rotation on padding rows


def test_cache_reuses_tables_and_is_bounded():
    cache = RopeCache(maxsize=2)
    a = cache.get((2, 3, 4), 24)
    assert cache.get((2, 3, 4), 24) is a and cache.hits == 1 and cache.misses == 1
    cache.get((2, 3, 4), 24, start=0, stop=12)
    cache.get((1, 3, 4), 24)
    assert len(cache) == 2  # LRU evicted the oldest
    assert cache.get((2, 3, 4), 24) is not a and cache.misses == 4
    with pytest.raises(ValueError, match="maxsize must be a positive integer"):
        RopeCache(0)


@pytest.mark.parametrize(
    "call, fragment",
    [
        (lambda: rope_tables((2, 3), 24), r"grid must be \(frames, height, width\)"),
        (lambda: rope_tables((2, 3, 0), 24), r"grid must be \(frames, height, width\)"),
        (lambda: rope_tables((2, 3, 4), 7), "head_dim must be a positive even integer"),
        (lambda: rope_tables((2, 3, 4), 24, start=5, stop=2), "start/stop must satisfy"),
        (lambda: rotate(torch.zeros(1, 4, 1, 6), torch.ones(1, 3, 1, 3, dtype=torch.complex64)), r"freqs must have shape"),
        (lambda: rotate(torch.zeros(1, 4, 1, 6), torch.ones(1, 4, 1, 3)), "freqs must be complex64"),
        (lambda: rotate(torch.zeros(4, 1, 6), torch.ones(1, 4, 1, 3, dtype=torch.complex64)), r"x must be \(B, S, N, D\)"),
        (lambda: apply_rotary_emb(torch.zeros(1, 4, 1, 6), torch.zeros(1, 4, 1, 6), torch.zeros(1, 4, 1, 4)), "freqs_cos / freqs_sin"),
    ],
)
def test_bad_input(call, fragment):
    with pytest.raises((ValueError, TypeError), match=fragment):
        call()


def test_axis_split_matches_diffusers():
    for d in (12, 24, 48, 64, 128):
        rope = WanRotaryPosEmbed(d, (1, 2, 2), 16)
        assert axis_dims(d) == (rope.t_dim, rope.h_dim, rope.w_dim)
