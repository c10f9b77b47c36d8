"""Block selection of sparse_attention: the reference rule, the budget option, the "subblock" selector.

References are independent of the library: the RainFusion 2.0 rule transcribed from its description
(8x8 spatial windows per frame, text moved behind the video, mean-pooled fp64 scores, top
``ceil((1 - sparsity) * kv_blocks)``, then text / first-frame blocks forced in both directions), and
exact fp64 softmax attention for the attention mass.
"""

import math

import pytest
import torch

from lite_boost import config as cfg_mod
from lite_boost.config import ConfigError, SparseConfig
from lite_boost.ops import rain_fusion as rf
from lite_boost.ops import sparse as sp
from lite_boost.ops import _sparse_mask as mask_mod
from lite_boost.ops._sparse_mask import block_scores
from lite_boost.ops.sparse import sparse_attention


def reference_order(grid, txt_len):
    """rf_v2 token order written out with loops: per frame 8x8 windows (raster order of windows,
    raster inside), then the rows/columns no full window covers in raster order; frame 0 stays
    raster when h or w is not a multiple of 8 (only 8-aligned grids are used below); text last."""
    t, h, w = grid
    order = []
    for f in range(t):
        covered = set()
        for wy in range(h // 8):
            for wx in range(w // 8):
                for y in range(wy * 8, wy * 8 + 8):
                    for x in range(wx * 8, wx * 8 + 8):
                        order.append(txt_len + (f * h + y) * w + x)
                        covered.add((y, x))
        order += [txt_len + (f * h + y) * w + x for y in range(h) for x in range(w) if (y, x) not in covered]
    return order + list(range(txt_len))


def reference_rule(q, k, grid, txt_len, block, sparsity, keep_recent):
    """Kept KV blocks per (head, query block) under the reference rule, as Python sets."""
    order = torch.tensor(reference_order(grid, txt_len))
    qo, ko = q[0][:, order].double(), k[0][:, order].double()
    n, s, d = qo.shape
    nb = math.ceil(s / block)
    pool = lambda x: torch.stack([x[:, i * block:(i + 1) * block].mean(1) for i in range(nb)], 1)  # noqa: E731
    probs = torch.softmax(pool(qo) @ pool(ko).transpose(-1, -2) * d ** -0.5, -1)
    keep = math.ceil((1 - sparsity) * nb)
    frame0 = set(range(txt_len, txt_len + grid[1] * grid[2])) if grid[0] > 1 else set()
    special = [any(int(order[j]) < txt_len or int(order[j]) in frame0 for j in range(i * block, min(s, (i + 1) * block)))
               for i in range(nb)]
    forced_cols = {j for j in range(nb) if special[j]}
    kept = {}
    for h in range(n):
        for i in range(nb):
            if special[i]:
                kept[h, i] = set(range(nb))
                continue
            top = torch.argsort(probs[h, i], descending=True, stable=True)[:keep].tolist()
            kept[h, i] = set(top) | forced_cols | ({i} if keep_recent else set())
    return kept


def kept_sets(stats, n):
    sel = stats.selection
    return {(h, i): set(sel.select_idx[i, h, : sel.select_num[i, h]].tolist())
            for i in range(stats.q_blocks) for h in range(n)}


def qkv(seed, s, n=2, d=16, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, n, s, d, generator=gen) * scale for _ in range(3))


@pytest.mark.parametrize("keep_recent", [False, True])
@pytest.mark.parametrize("sparsity", [0.5, 0.8])
def test_reference_selector_keeps_exactly_the_reference_rule(keep_recent, sparsity):
    """window=None, selector="reference", default budget: top-k by pooled score, forced blocks on top."""
    grid, txt, block = (3, 8, 16), 9, 32
    q, k, v = qkv(0, txt + math.prod(grid), scale=2.0)
    out, stats = sparse_attention(q, k, v, head_num=2, sparse_type="rf_v2", txt_len=txt, block_size=block,
                                  latent_shape_q=grid, sparsity=sparsity, keep_recent=keep_recent,
                                  selector="reference", return_stats=True, backend="gather")
    assert stats.selector == "reference" and stats.budget == "reference"
    expected = reference_rule(q, k, grid, txt, block, sparsity, keep_recent)
    assert kept_sets(stats, 2) == expected
    # the forced blocks come on top: rows that are not forced keep more than the top-k
    keep = math.ceil((1 - sparsity) * stats.kv_blocks)
    assert max(len(x) for x in expected.values()) > keep


def test_budget_total_counts_forced_blocks_and_reference_adds_them():
    grid, txt, block = (3, 8, 16), 9, 32
    q, k, v = qkv(1, txt + math.prod(grid), scale=2.0)
    kw = dict(head_num=2, sparse_type="rf_v2", txt_len=txt, block_size=block, latent_shape_q=grid, sparsity=0.8,
              return_stats=True, backend="gather")
    for selector in ("reference", "subblock"):
        _, tot = sparse_attention(q, k, v, budget="total", selector=selector, **kw)
        _, ref = sparse_attention(q, k, v, selector=selector, **kw)
        nkb = tot.kv_blocks
        keep = math.ceil(0.2 * nkb)
        t_sets, r_sets = kept_sets(tot, 2), kept_sets(ref, 2)
        # text and first-frame blocks, from the documented order (first frame, then text last)
        order = reference_order(grid, txt)
        frame0 = range(txt, txt + grid[1] * grid[2])
        forced_cols = {j // block for j, tok in enumerate(order) if tok < txt or tok in frame0}
        forced_rows = forced_cols
        assert forced_cols and forced_cols <= set.intersection(*r_sets.values())
        for key, s in t_sets.items():
            if key[1] in forced_rows:
                assert s == set(range(nkb))
                continue
            n_forced = len(forced_cols | {key[1]})
            assert len(s) == max(keep, n_forced) and forced_cols <= s  # hard cap, forced included
            assert len(r_sets[key]) >= len(s) and forced_cols <= r_sets[key]
        # effective sparsity reports what was computed: the reference budget computes more
        assert ref.effective_sparsity < tot.effective_sparsity
        assert tot.budget == "total" and ref.budget == "reference"


def exact_block_mass(q, k, block):
    """(N, nqb, nkb) fp64: mean over each query block of the softmax mass per key block."""
    n, s, d = q.shape[1:]
    p = torch.softmax(q[0].double() @ k[0].double().transpose(-1, -2) * d ** -0.5, -1)
    nb = math.ceil(s / block)
    col = torch.zeros(n, s, nb, dtype=torch.float64).index_add_(2, torch.arange(s) // block, p)
    mass = torch.zeros(n, nb, nb, dtype=torch.float64).index_add_(1, torch.arange(s) // block, col)
    counts = torch.bincount(torch.arange(s) // block).double()
    return mass / counts[None, :, None]


@pytest.mark.parametrize("s,block", [(96, 16), (100, 16), (90, 12)])
def test_subblock_with_one_token_per_representative_is_the_exact_block_mass(s, block):
    """With q_reps = k_reps = block_size every representative is one token: the estimate is exact
    (tail blocks and run sizes that do not divide the block included)."""
    q, k, _ = qkv(2, s, d=8, scale=1.5)
    score, probs = block_scores(q, k, block, 8 ** -0.5, "subblock", block, block)
    torch.testing.assert_close(probs[0].double(), exact_block_mass(q, k, block), atol=1e-5, rtol=1e-4)
    assert score is probs


def subblock_estimate_loops(q, k, block, scale, q_reps, k_reps, outliers=4):
    """The "subblock" estimate written out per block with fp64 loops: runs of ``p * reps // block``,
    the ``outliers`` keys farthest from their run mean as single-token representatives, each run
    mean weighted by its token count with the isotropic Gaussian term 0.5 scale^2 |q|^2 var."""
    n, s, d = q.shape[1:]
    nb = math.ceil(s / block)
    qd, kd = q[0].double(), k[0].double()
    out = torch.zeros(n, nb, nb, dtype=torch.float64)
    for h in range(n):
        reps = []  # (block index, mean, count, mean per-channel variance)
        for j in range(nb):
            toks = list(range(j * block, min(s, (j + 1) * block)))
            run = {t: (t - j * block) * k_reps // block for t in toks}
            mean = {r: torch.stack([kd[h, t] for t in toks if run[t] == r]).mean(0)
                    for r in set(run.values())}
            far = sorted(toks, key=lambda t: -float((kd[h, t] - mean[run[t]]).square().sum()))[:outliers]
            for r in range(k_reps):
                members = [t for t in toks if run[t] == r and t not in far]
                if members:
                    x = kd[h, members]
                    reps.append((j, x.mean(0), len(members), float(x.var(0, unbiased=False).mean())))
            reps += [(j, kd[h, t], 1, 0.0) for t in far]
        for i in range(nb):
            toks = list(range(i * block, min(s, (i + 1) * block)))
            groups = {}
            for t in toks:
                groups.setdefault((t - i * block) * q_reps // block, []).append(t)
            for members in groups.values():
                qm = qd[h, members].mean(0)
                logit = torch.tensor([scale * float(qm @ km) + 0.5 * scale ** 2 * float(qm @ qm) * var + math.log(cnt)
                                      for _, km, cnt, var in reps], dtype=torch.float64)
                p = torch.softmax(logit, 0)
                for (j, *_), pj in zip(reps, p):
                    out[h, i, j] += pj * len(members) / len(toks)
    return out


@pytest.mark.parametrize("s,block,reps", [(80, 16, (4, 2)), (75, 16, (8, 4)), (60, 12, (5, 3))])
def test_subblock_estimate_matches_a_loop_transcription(s, block, reps):
    """Sub-block runs, outlying keys, variance term and token weights against per-block fp64 loops
    (tail blocks, runs that do not divide the block)."""
    q, k, _ = qkv(7, s, n=2, d=8, scale=1.5)
    k[0, :, 5] += 4.0  # an outstanding key
    _, probs = block_scores(q, k, block, 8 ** -0.5, "subblock", *reps)
    torch.testing.assert_close(probs[0].double(), subblock_estimate_loops(q, k, block, 8 ** -0.5, *reps),
                               atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_subblock_scores_do_not_depend_on_the_working_chunk(monkeypatch, dtype):
    """The bounded working chunks (keys, queries, logits) change the memory, not the estimate."""
    q, k, _ = qkv(8, 1000, n=3, d=16)
    q, k = q.to(dtype), k.to(dtype)
    whole, _ = block_scores(q, k, 64, 0.25, "subblock", 32, 8)
    monkeypatch.setattr(mask_mod, "_CHUNK_ELEMS", 300)  # one block (or less) per chunk
    chunked, _ = block_scores(q, k, 64, 0.25, "subblock", 32, 8)
    torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(whole.sum(-1), torch.ones_like(whole[..., 0]))


def test_subblock_logits_on_onednn_and_on_blas_agree(monkeypatch):
    """The logit product runs on oneDNN where PyTorch has it and on torch.matmul otherwise: the same
    fp32 estimate either way (and the same kept blocks), GQA included."""
    q, k, _ = qkv(9, 700, n=4, d=16, scale=1.5)
    k = k[:, :2]
    if mask_mod._onednn_linear() is None:
        pytest.skip("this PyTorch has no oneDNN")
    calls = []
    lin = mask_mod._onednn_linear()
    monkeypatch.setattr(mask_mod, "_onednn_linear", lambda: lambda *a: calls.append(1) or lin(*a))
    fast, _ = block_scores(q, k, 64, 0.25, "subblock", 32, 8)
    assert calls  # the oneDNN product ran
    monkeypatch.setattr(mask_mod, "_onednn_linear", lambda: None)
    blas, _ = block_scores(q, k, 64, 0.25, "subblock", 32, 8)
    torch.testing.assert_close(fast, blas, atol=1e-6, rtol=1e-5)
    assert torch.equal(fast.topk(3, dim=-1).indices, blas.topk(3, dim=-1).indices)


def test_subblock_selection_is_deterministic_and_independent_of_head_chunking():
    grid, block = (4, 8, 8), 16
    q, k, v = qkv(3, math.prod(grid), n=4)
    kw = dict(head_num=4, sparse_type="rf_v2", block_size=block, latent_shape_q=grid, sparsity=0.7,
              return_stats=True, backend="gather")
    _, a = sparse_attention(q, k, v, head_chunk=1, **kw)
    _, b = sparse_attention(q, k, v, head_chunk=4, **kw)
    _, c = sparse_attention(q.clone(), k.clone(), v.clone(), head_chunk=2, **kw)
    assert a.selector == "subblock"  # the default
    for other in (b, c):
        assert torch.equal(a.selection.select_num, other.selection.select_num)
        m = a.selection.select_num.max()
        assert torch.equal(a.selection.select_idx[..., :m], other.selection.select_idx[..., :m])
    # the rain_fusion contract: (B * q_blocks, N, M) ascending indices, -1 padding after select_num
    si, sn = a.selection.select_idx, a.selection.select_num
    assert si.shape[:2] == (a.q_blocks, 4) and sn.shape == (a.q_blocks, 4) and si.dtype == torch.int64
    valid = torch.arange(si.shape[-1]) < sn[..., None]
    assert torch.all(torch.where(valid, si, 0) < a.kv_blocks) and torch.all(si[~valid] == -1)
    sorted_ok = (si[..., 1:] > si[..., :-1]) | ~valid[..., 1:]
    assert torch.all(sorted_ok)


def test_subblock_gqa_scores_use_the_shared_key_head():
    q, k, _ = qkv(4, 64, n=4, d=8)
    kg = k[:, :2]
    s_gqa, _ = block_scores(q, kg, 16, 8 ** -0.5, "subblock", 4, 8)
    s_rep, _ = block_scores(q, kg.repeat_interleave(2, 1), 16, 8 ** -0.5, "subblock", 4, 8)
    torch.testing.assert_close(s_gqa, s_rep)


def small_sinks_case(seed):
    """A few key tokens with a large component along every query: the attention concentrates on
    them, but each holds only 4 of a 32-token block, so a block mean dilutes them."""
    gen = torch.Generator().manual_seed(seed)
    n, s, d, block = 2, 1024, 16, 32
    q = torch.randn(1, n, s, d, generator=gen)
    k = torch.randn(1, n, s, d, generator=gen)
    v = torch.randn(1, n, s, d, generator=gen)
    direction = torch.randn(n, 1, d, generator=gen)
    q[0] += 2.0 * direction
    for start in torch.randperm(s // 4, generator=gen)[:6].tolist():
        k[0, :, start * 4:start * 4 + 4] += 2.5 * direction
    return q, k, v, block


def recall(q, k, stats, block):
    """Mean over queries of the exact softmax mass inside the kept blocks (raster order)."""
    mass = exact_block_mass(q, k, block)  # (N, nqb, nkb)
    kept = torch.zeros_like(mass, dtype=torch.bool)
    for (h, i), cols in kept_sets(stats, q.shape[1]).items():
        kept[h, i, list(cols)] = True
    return float((mass * kept).sum(-1).mean())


def test_subblock_beats_reference_at_equal_density():
    """Same number of blocks per row (budget="total"); never worse on any seed (seed 1 is a tie: both
    keep 0.925 of the mass), clearly better on average."""
    gains = []
    for seed in range(4):
        q, k, v, block = small_sinks_case(seed)
        kw = dict(head_num=2, sparse_type="rf_v2", block_size=block, latent_shape_q=(1, 32, 32), sparsity=0.85,
                  window="raster", budget="total", return_stats=True, backend="gather")
        _, ref = sparse_attention(q, k, v, selector="reference", **kw)
        _, new = sparse_attention(q, k, v, selector="subblock", **kw)
        assert new.effective_sparsity == ref.effective_sparsity  # the same compute
        r_ref, r_new = recall(q, k, ref, block), recall(q, k, new, block)
        assert r_new >= r_ref - 1e-3, (seed, r_new, r_ref)  # never worse (a tie within 0.1% of the mass counts)
        gains.append(r_new - r_ref)
    assert sum(gains) / len(gains) > 0.05, gains


def test_config_names_match_the_ops():
    assert cfg_mod.SPARSE_SELECTORS == sp.SELECTORS and cfg_mod.SPARSE_BUDGETS == sp.BUDGETS
    assert SparseConfig().selector == sp.SELECTORS[0] and SparseConfig().budget == "reference"


@pytest.mark.parametrize("changes,match", [
    (dict(budget="hard"), r"budget must be one of \['reference', 'total'\]"),
    (dict(selector="rf_v3"), r"selector must be one of \['subblock', 'reference'\]"),
    (dict(selector_reps=(0, 4)), r"selector_reps must be two ints .* in \[1, block_size=16\]"),
    (dict(selector_reps=(4, 32)), r"selector_reps must be two ints"),
    (dict(selector_reps=4), r"selector_reps must be two ints"),
    (dict(selector_reps=(2.0, 4)), r"selector_reps must be two ints"),
])
def test_bad_selector_input_raises_before_any_work(monkeypatch, changes, match):
    def boom(*a, **k):
        raise AssertionError("work started before validation finished")

    monkeypatch.setattr(sp, "block_scores", boom)
    monkeypatch.setattr(sp, "select_blocks", boom)
    monkeypatch.setattr(rf, "_dispatch", boom)
    q = torch.randn(1, 2, 64, 8)
    with pytest.raises(ValueError, match=match):
        sparse_attention(q, q, q, head_num=2, sparse_type="rf_v2", block_size=16, latent_shape_q=(1, 8, 8),
                         sparsity=0.5, **changes)


@pytest.mark.parametrize("changes,match", [
    (dict(budget="all"), "budget must be one of"),
    (dict(selector="mean"), "selector must be one of"),
    (dict(selector_reps=(8, 0)), "selector_reps must be None or two positive ints"),
    (dict(selector_reps=(8, 256)), "must not exceed block_size=128"),
])
def test_bad_selector_config(changes, match):
    with pytest.raises(ConfigError, match=match):
        SparseConfig(**changes)
