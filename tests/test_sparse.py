"""sparse_attention: token orders, mask rules, the whole rf_v2 path against dense references."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from lite_boost.ops import sparse as sp
from lite_boost.ops import rain_fusion as rf
from lite_boost.ops._sparse_kernels import block_mask_dense
from lite_boost.ops._sparse_layout import token_order
from lite_boost.ops._sparse_mask import select_blocks
from lite_boost.ops.sparse import BlockSelection, sparse_attention


def dense_reference(q, k, v, allowed=None, scale=None):
    """fp64 attention on BNSD tensors (GQA by repetition); ``allowed`` (B, N, Sq, Skv) bool."""
    g = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = q.double() @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    return torch.softmax(s, -1) @ v


def allowed_in_input_order(stats, b, n1, sq, skv, lq, lk, window, txt_len, block):
    """Token mask of the selection, mapped back from the reordered sequence to the input order."""
    sel = stats.selection
    oq, ok = token_order(lq, window, txt_len), token_order(lk, window, txt_len)
    nqb = math.ceil(sq / block)
    out = torch.zeros(b, n1, sq, skv, dtype=torch.bool)
    for bi in range(b):
        rows = slice(bi * nqb, (bi + 1) * nqb)
        m = block_mask_dense(sel.select_idx[rows], sel.select_num[rows], (block, block), sq, skv)
        out[bi][:, oq.perm[:, None], ok.perm[None, :]] = m
    return out


def rand_bnsd(gen, b, n, s, d, dtype=torch.float32):
    return torch.randn(b, n, s, d, generator=gen).to(dtype)


# --------------------------------------------------------------------------------------------- #
# token orders                                                                                   #
# --------------------------------------------------------------------------------------------- #

GRIDS = [(1, 30, 52), (21, 30, 52), (21, 45, 80), (3, 7, 5), (1, 1, 1), (5, 3, 3), (2, 9, 17)]
WINDOWS = ["raster", None, (2, 8, 8), (4, 4, 8), (1, 8, 16), (3, 2, 2)]


@pytest.mark.parametrize("grid", GRIDS, ids=str)
@pytest.mark.parametrize("window", WINDOWS, ids=str)
def test_token_order_round_trip(grid, window):
    txt = 3
    o = token_order(grid, window, txt)
    n = math.prod(grid) + txt
    assert torch.equal(torch.sort(o.perm).values, torch.arange(n))
    x = torch.randn(n, 2)
    assert torch.equal(x[o.perm][o.inv], x)
    assert torch.all(o.perm[-txt:] == torch.arange(txt)) and o.is_text.sum() == txt
    # the sink flags mark exactly the frame-0 video tokens of multi-frame grids
    frame0 = (o.perm >= txt) & (o.perm < txt + grid[1] * grid[2])
    assert torch.equal(o.is_sink, frame0 if grid[0] > 1 else torch.zeros_like(frame0))


@pytest.mark.parametrize("grid", [(21, 30, 52), (9, 13, 11), (5, 30, 52)], ids=str)
@pytest.mark.parametrize("window", [(2, 8, 8), (4, 4, 8), (1, 4, 4)], ids=str)
def test_full_windows_are_whole_blocks(grid, window):
    """Every leading block is one compact (wt, wh, ww) box of the grid, never straddling two."""
    block = math.prod(window)
    o = token_order(grid, window, 0)
    t, h, w = grid
    coords = torch.stack([o.perm // (h * w), (o.perm // w) % h, o.perm % w], 1)
    first = 1 if t > 1 else 0
    n_full = ((t - first) // window[0]) * (h // window[1]) * (w // window[2])
    assert n_full > 0
    boxes = coords[: n_full * block].view(n_full, block, 3)
    span = boxes.max(1).values - boxes.min(1).values + 1
    assert torch.all(span == torch.tensor(window))
    assert torch.all(boxes[:, :, 0] >= first)  # frame 0 stays out of the full windows


def test_reference_order_matches_documented_rule():
    """8x8 windows per frame, leftovers raster; frame 0 raster when the grid is not 8-aligned."""
    o = token_order((2, 10, 8), None, 0)
    frame0 = o.perm[:80]
    assert torch.equal(frame0, torch.arange(80))  # h = 10 is not a multiple of 8
    frame1 = o.perm[80:] - 80
    assert torch.equal(frame1[:64], (torch.arange(8)[:, None] * 8 + torch.arange(8)).flatten())
    assert torch.equal(frame1[64:], torch.arange(64, 80))


# --------------------------------------------------------------------------------------------- #
# mask rules                                                                                     #
# --------------------------------------------------------------------------------------------- #


def _select(pq, pk, keep, forced_q=None, forced_kv=None, diagonal=None, cdf=1.0, budget="total"):
    nqb, nkb = pq.shape[2], pk.shape[2]
    fq = torch.zeros(nqb, dtype=torch.bool) if forced_q is None else forced_q
    fk = torch.zeros(nkb, dtype=torch.bool) if forced_kv is None else forced_kv
    return select_blocks(pq @ pk.transpose(-1, -2), None, keep, fq, fk, diagonal, cdf, torch.ones(nqb),
                         torch.ones(nkb), budget)


@settings(max_examples=30, deadline=None)
@given(nqb=st.integers(1, 9), nkb=st.integers(1, 12), keep=st.integers(1, 12), seed=st.integers(0, 2**31 - 1),
       ties=st.booleans())
def test_exactly_k_blocks_and_they_are_the_top_k(nqb, nkb, keep, seed, ties):
    gen = torch.Generator().manual_seed(seed)
    pq = torch.randn(2, 3, nqb, 4, generator=gen)
    pk = torch.randn(2, 3, nkb, 4, generator=gen)
    if ties:  # all scores equal: a threshold rule would keep everything
        pk = torch.zeros_like(pk)
    idx, num, _ = _select(pq, pk, keep)
    k = min(keep, nkb)
    assert torch.all(num == k)
    scores = pq @ pk.transpose(-1, -2)
    for b in range(2):
        for h in range(3):
            for i in range(nqb):
                row = idx[b * nqb + i, h, :k]
                assert torch.all(row[1:] > row[:-1])
                kept = scores[b, h, i, row]
                dropped = torch.ones(nkb, dtype=torch.bool)
                dropped[row] = False
                if dropped.any():
                    assert kept.min() >= scores[b, h, i, dropped].max() - 1e-6
                if ties:  # ties go to the lower indices
                    assert torch.equal(row, torch.arange(k))


def test_forced_rows_columns_and_diagonal():
    gen = torch.Generator().manual_seed(0)
    pq, pk = torch.randn(1, 2, 6, 4, generator=gen), torch.randn(1, 2, 8, 4, generator=gen)
    fq = torch.tensor([False, False, True, False, False, False])
    fk = torch.tensor([False] * 7 + [True])
    diag = torch.arange(6) * 8 // 6
    idx, num, _ = _select(pq, pk, 3, fq, fk, diag)
    for i in range(6):
        for h in range(2):
            row = idx[i, h, : num[i, h]].tolist()
            if i == 2:
                assert row == list(range(8))  # forced row: dense
            else:
                assert num[i, h] == 3 and 7 in row and int(diag[i]) in row  # budget includes forced blocks


def test_cdf_threshold_keeps_fewer_never_more():
    gen = torch.Generator().manual_seed(1)
    pq, pk = torch.randn(1, 1, 4, 4, generator=gen) * 3, torch.randn(1, 1, 10, 4, generator=gen) * 3
    _, full, _ = _select(pq, pk, 5)
    _, part, _ = _select(pq, pk, 5, cdf=0.5)
    assert torch.all(part <= full) and torch.all(part >= 1) and bool((part < full).any())


def test_masks_are_per_batch_element():
    """Two different batch elements get their own masks; each equals the mask computed alone."""
    gen = torch.Generator().manual_seed(2)
    grid, block = (3, 8, 8), 32
    q, k, v = (rand_bnsd(gen, 2, 2, 192, 16) for _ in range(3))
    kw = dict(head_num=2, sparse_type="rf_v2", block_size=block, latent_shape_q=grid, sparsity=0.75,
              window=(2, 4, 4), return_stats=True, backend="gather", keep_sink=False)
    _, both = sparse_attention(q, k, v, **kw)
    _, first = sparse_attention(q[:1], k[:1], v[:1], **kw)
    _, second = sparse_attention(q[1:], k[1:], v[1:], **kw)
    nqb = 192 // block
    assert torch.equal(both.selection.select_idx[:nqb], first.selection.select_idx)
    assert torch.equal(both.selection.select_idx[nqb:], second.selection.select_idx)
    assert not torch.equal(first.selection.select_idx, second.selection.select_idx)


# --------------------------------------------------------------------------------------------- #
# the whole rf_v2 path                                                                           #
# --------------------------------------------------------------------------------------------- #


@settings(max_examples=15, deadline=None)
@given(grid=st.sampled_from([(3, 5, 7), (1, 6, 10), (4, 3, 5), (2, 8, 8)]),
       window=st.sampled_from(["raster", None, (2, 2, 4), (1, 4, 4)]),
       txt_len=st.sampled_from([0, 5]), group=st.sampled_from([1, 2]), sparsity=st.sampled_from([0.3, 0.6, 0.9]),
       keep_sink=st.booleans(), keep_recent=st.booleans(), layout=st.sampled_from(["BNSD", "BSND", "BSH"]),
       batch=st.sampled_from([1, 2]), seed=st.integers(0, 2**31 - 1))
def test_rf_v2_equals_masked_dense_attention(grid, window, txt_len, group, sparsity, keep_sink, keep_recent,
                                             layout, batch, seed):
    """Output == fp64 attention under the reported block mask mapped back to input order (each head group's
    reordered copies and its output written back by row gathers into reused buffers, for any batch)."""
    gen = torch.Generator().manual_seed(seed)
    block, n2, d = 16, 2, 8
    n1 = n2 * group
    s = math.prod(grid) + txt_len
    q4, k4, v4 = rand_bnsd(gen, batch, n1, s, d), rand_bnsd(gen, batch, n2, s, d), rand_bnsd(gen, batch, n2, s, d)
    conv = {"BNSD": lambda t: t, "BSND": lambda t: t.transpose(1, 2), "BSH": lambda t: t.transpose(1, 2).flatten(2)}[layout]
    out, stats = sparse_attention(conv(q4), conv(k4), conv(v4), head_num=n1, input_layout=layout, sparse_type="rf_v2",
                                  txt_len=txt_len, block_size=block, latent_shape_q=grid, keep_sink=keep_sink,
                                  keep_recent=keep_recent, sparsity=sparsity, window=window,
                                  return_stats=True, backend="gather")
    assert out.shape == conv(q4).shape
    if stats.path == "dense":
        allowed = None
    else:
        allowed = allowed_in_input_order(stats, batch, n1, s, s, grid, grid, window, txt_len, block)
        # forced text blocks: every query attends to every text key, text queries attend to all keys
        if txt_len:
            assert allowed[..., :txt_len].all() and allowed[:, :, :txt_len].all()
        if keep_sink and grid[0] > 1:
            f0 = slice(txt_len, txt_len + grid[1] * grid[2])
            assert allowed[..., f0].all() and allowed[:, :, f0].all()
        density = allowed.double().mean().item()
        assert stats.effective_sparsity == pytest.approx(1 - density, abs=1e-6)
    ref = dense_reference(q4, k4, v4, allowed)
    torch.testing.assert_close(out, conv(ref.float()), atol=1e-5, rtol=1e-5)


def test_gradients_flow_through_the_sparse_path():
    """With inputs that require grad the reorders and the write-back are differentiable: the gradients of
    q, k, v equal those of fp64 attention under the same block mask (gather backend, GQA; batch 1: the
    gather backend's per-batch output copy is not differentiable for several batches)."""
    batch = 1
    gen = torch.Generator().manual_seed(5)
    grid, block = (2, 8, 8), 16
    s = math.prod(grid)
    q4, k4, v4 = rand_bnsd(gen, batch, 4, s, 8), rand_bnsd(gen, batch, 2, s, 8), rand_bnsd(gen, batch, 2, s, 8)
    leaves = [t.clone().requires_grad_() for t in (q4, k4, v4)]
    out, stats = sparse_attention(*leaves, head_num=4, sparse_type="rf_v2", block_size=block, latent_shape_q=grid,
                                  sparsity=0.6, window=(1, 4, 4), return_stats=True, backend="gather")
    assert stats.path == "sparse"
    w = torch.randn(out.shape, generator=gen)
    (out * w).sum().backward()
    ref_leaves = [t.double().requires_grad_() for t in (q4, k4, v4)]
    allowed = allowed_in_input_order(stats, batch, 4, s, s, grid, grid, (1, 4, 4), 0, block)
    (dense_reference(*ref_leaves, allowed) * w.double()).sum().backward()
    for got, ref in zip(leaves, ref_leaves):
        torch.testing.assert_close(got.grad, ref.grad.float(), atol=1e-5, rtol=1e-4)


def test_sparsity_zero_equals_dense_for_all_layouts():
    gen = torch.Generator().manual_seed(3)
    q4, k4, v4 = rand_bnsd(gen, 2, 4, 7 + 60, 8), rand_bnsd(gen, 2, 2, 67, 8), rand_bnsd(gen, 2, 2, 67, 8)
    ref = dense_reference(q4, k4, v4).float()
    for layout, conv in (("BNSD", lambda t: t), ("BSND", lambda t: t.transpose(1, 2)),
                         ("BSH", lambda t: t.transpose(1, 2).flatten(2))):
        for sparse_type in (None, "rf_v2"):
            out = sparse_attention(conv(q4), conv(k4), conv(v4), head_num=4, input_layout=layout,
                                   sparse_type=sparse_type, txt_len=7, block_size=16, latent_shape_q=(3, 4, 5),
                                   sparsity=0.0)
            torch.testing.assert_close(out, conv(ref), atol=1e-5, rtol=1e-5)


def test_reused_selection_gives_the_same_output_and_checks_shape():
    gen = torch.Generator().manual_seed(4)
    q, k, v = (rand_bnsd(gen, 1, 2, 96, 8) for _ in range(3))
    kw = dict(head_num=2, sparse_type="rf_v2", block_size=16, latent_shape_q=(2, 6, 8), sparsity=0.6,
              window=(1, 4, 4), backend="gather")
    out, stats = sparse_attention(q, k, v, return_stats=True, **kw)
    q2 = q + 0.5 * torch.randn(q.shape, generator=gen)
    again, st2 = sparse_attention(q2, k, v, selection=stats.selection, return_stats=True, **kw)
    assert st2.reused and st2.selection is stats.selection
    assert st2.effective_sparsity == pytest.approx(stats.effective_sparsity)
    allowed = allowed_in_input_order(stats, 1, 2, 96, 96, (2, 6, 8), (2, 6, 8), (1, 4, 4), 0, 16)
    torch.testing.assert_close(again, dense_reference(q2, k, v, allowed).float(), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="selection was computed for another call shape"):
        sparse_attention(q, k, v, selection=stats.selection, **{**kw, "block_size": 32, "window": (2, 4, 4)})


def test_latent_shape_k_is_honoured():
    """K on another grid (fewer frames): blocks and sink follow k's own grid."""
    gen = torch.Generator().manual_seed(5)
    lq, lk = (3, 4, 8), (2, 4, 8)
    q, k, v = rand_bnsd(gen, 1, 2, 96, 8), rand_bnsd(gen, 1, 2, 64, 8), rand_bnsd(gen, 1, 2, 64, 8)
    out, stats = sparse_attention(q, k, v, head_num=2, sparse_type="rf_v2", block_size=16, latent_shape_q=lq,
                                  latent_shape_k=lk, sparsity=0.5, window=(1, 4, 4), return_stats=True, backend="gather")
    allowed = allowed_in_input_order(stats, 1, 2, 96, 64, lq, lk, (1, 4, 4), 0, 16)
    assert allowed[..., :32].all()  # k's frame 0 (32 tokens) is the sink
    torch.testing.assert_close(out, dense_reference(q, k, v, allowed).float(), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="latent_shape_k is required"):
        sparse_attention(q, k, v, head_num=2, sparse_type="rf_v2", block_size=16, latent_shape_q=lq, sparsity=0.5)


def test_text_with_unaligned_video_length_forces_the_straddling_block():
    """Video 105 tokens, block 16: block 6 holds 9 video + 7 text tokens and must be forced."""
    gen = torch.Generator().manual_seed(6)
    txt = 7
    s = txt + 105
    q, k, v = (rand_bnsd(gen, 1, 1, s, 8) for _ in range(3))
    out, stats = sparse_attention(q, k, v, sparse_type="rf_v2", txt_len=txt, block_size=16, latent_shape_q=(3, 5, 7),
                                  sparsity=0.8, keep_sink=False, keep_recent=False, window="raster",
                                  return_stats=True, backend="gather", budget="total")
    sel = stats.selection
    assert stats.kv_blocks == 7  # 112 tokens
    assert torch.all(sel.select_num[6] == 7)  # the straddling block's queries see every block
    assert torch.all(sel.select_num[:6] == 2)  # ceil(0.2 * 7) = 2 including the forced text block
    for i in range(7):
        assert 6 in sel.select_idx[i, 0, : sel.select_num[i, 0]].tolist()
    allowed = allowed_in_input_order(stats, 1, 1, s, s, (3, 5, 7), (3, 5, 7), "raster", txt, 16)
    assert allowed[..., :txt].all() and allowed[:, :, :txt].all()


def test_min_seq_len_falls_back_to_dense_and_reports_it():
    gen = torch.Generator().manual_seed(7)
    q, k, v = (rand_bnsd(gen, 1, 1, 64, 8) for _ in range(3))
    out, stats = sparse_attention(q, k, v, sparse_type="rf_v2", block_size=16, latent_shape_q=(1, 8, 8), sparsity=0.9,
                                  min_seq_len=65, return_stats=True)
    assert stats.path == "dense" and "min_seq_len" in stats.reason and stats.effective_sparsity == 0.0
    torch.testing.assert_close(out, dense_reference(q, k, v).float(), atol=1e-5, rtol=1e-5)
    _, stats = sparse_attention(q, k, v, sparse_type="rf_v2", block_size=16, latent_shape_q=(1, 8, 8), sparsity=0.9,
                                min_seq_len=64, return_stats=True, backend="gather")
    assert stats.path == "sparse"


def test_effective_sparsity_without_forced_blocks_is_the_budget():
    gen = torch.Generator().manual_seed(8)
    q, k, v = (rand_bnsd(gen, 1, 2, 256, 8) for _ in range(3))
    _, stats = sparse_attention(q, k, v, head_num=2, sparse_type="rf_v2", block_size=16, latent_shape_q=(4, 8, 8),
                                sparsity=0.75, keep_sink=False, keep_recent=False, return_stats=True, backend="gather")
    assert stats.effective_sparsity == pytest.approx(0.75) and stats.q_blocks == 16 and stats.kv_blocks == 16


def test_fp16_extremes_no_nan():
    gen = torch.Generator().manual_seed(9)
    q, k, v = (rand_bnsd(gen, 1, 2, 128, 16) for _ in range(3))
    q16, k16 = (q * 30).half(), (k * 30).half()
    out, stats = sparse_attention(q16, k16, v.half(), head_num=2, sparse_type="rf_v2", block_size=32,
                                  latent_shape_q=(2, 8, 8), sparsity=0.5, return_stats=True, backend="gather")
    assert torch.isfinite(out).all()
    allowed = allowed_in_input_order(stats, 1, 2, 128, 128, (2, 8, 8), (2, 8, 8), None, 0, 32)
    ref = dense_reference(q16.float(), k16.float(), v.half().float(), allowed)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(rf.FLEX.probe("cpu") is not None, reason="no compiler for FlexAttention")
def test_automatic_backend_on_cpu_is_compiled_flex_and_matches_gather():
    gen = torch.Generator().manual_seed(10)
    q, k, v = (rand_bnsd(gen, 1, 4, 3 * 8 * 12, 32) for _ in range(3))
    kw = dict(head_num=4, sparse_type="rf_v2", block_size=32, latent_shape_q=(3, 8, 12), sparsity=0.7,
              window=(2, 4, 4), return_stats=True)
    out, stats = sparse_attention(q, k, v, backend=None if rf.available_sparse_backends()["cpp"] else "flex", **kw)
    assert stats.backend == "flex"  # automatic when the C++ library (first in the CPU order) is not built
    ref, _ = sparse_attention(q, k, v, backend="gather", **kw)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------- #
# bad input                                                                                      #
# --------------------------------------------------------------------------------------------- #


def _args():
    q = torch.randn(1, 2, 64 + 4, 8)
    return dict(q=q, k=q.clone(), v=q.clone(), head_num=2, sparse_type="rf_v2", txt_len=4, block_size=16,
                latent_shape_q=(1, 8, 8), sparsity=0.5)


BAD = [
    (dict(input_layout="SBH"), ValueError, "input_layout must be one of"),
    (dict(head_num=3), ValueError, "head_num=3 is inconsistent"),
    (dict(head_num=0), ValueError, "head_num must be a positive int"),
    (dict(latent_shape_q=(2, 8, 8)), ValueError, "latent_shape_q .* has 128 tokens"),
    (dict(latent_shape_q=(8, 8)), ValueError, "latent_shape_q must be None or three"),
    (dict(latent_shape_q=None), ValueError, "latent_shape_q .* is required"),
    (dict(latent_shape_k=(1, 4, 8)), ValueError, "latent_shape_k .* has 32 tokens"),
    (dict(sparsity=1.0), ValueError, r"sparsity must be a number in \[0.0, 1.0\)"),
    (dict(sparsity=-0.1), ValueError, "sparsity"),
    (dict(sparsity=float("nan")), ValueError, "sparsity"),
    (dict(block_size=0), ValueError, "block_size must be a positive int"),
    (dict(window=(2, 2, 2)), ValueError, "window volume must equal block_size=16"),
    (dict(sparse_type="rf_v3"), ValueError, "sparse_type must be one of"),
    (dict(txt_len=100), ValueError, "txt_len must be an int"),
    (dict(cdf_threshold=0.0), ValueError, "cdf_threshold"),
    (dict(keep_sink=1), TypeError, "keep_sink must be True or False"),
    (dict(attn_mask=torch.ones(68, 68, dtype=torch.bool)), ValueError, "attn_mask"),
    (dict(v=torch.randn(1, 2, 68, 8).half()), TypeError, "share one dtype"),
    (dict(inner_precise=3), ValueError, "inner_precise"),
    (dict(min_seq_len=-1), ValueError, "min_seq_len"),
    (dict(head_chunk=3), ValueError, "head_chunk"),
    (dict(backend="cuda_magic"), ValueError, "backend must be one of"),
    (dict(selection="mask"), TypeError, "selection must be a BlockSelection"),
    (dict(windw=(1, 4, 4)), TypeError, "unexpected keyword argument"),
]


@pytest.mark.parametrize("changes,exc,match", BAD, ids=[m for _, _, m in BAD])
def test_bad_input_raises_before_any_work(monkeypatch, changes, exc, match):
    def boom(*a, **k):
        raise AssertionError("work started before validation finished")

    monkeypatch.setattr(sp, "select_blocks", boom)
    monkeypatch.setattr(sp, "_dense", boom)
    monkeypatch.setattr(rf, "_dispatch", boom)
    with pytest.raises(exc, match=match):
        sparse_attention(**{**_args(), **changes})


def test_block_size_not_accepted_by_forced_backend(monkeypatch):
    """FlexAttention on CUDA needs multiples of 128: a forced backend is refused before any work."""
    ctx = rf._Context("cuda", torch.float32, False, False, (96, 96), 1, 1, 0)
    assert "multiples of 128" in rf._reject_flex(ctx)
