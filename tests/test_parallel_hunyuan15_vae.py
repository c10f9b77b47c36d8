"""Parallel VAE for HunyuanVideo-1.5 (lite_boost.models.hunyuan_video15_vae) against the sequential diffusers VAE.

Single-process: the runner's replicate-edge halo rows.
"""

import pytest
import torch

from lite_boost.parallel.comm import Communicator
from lite_boost.parallel.vae import SpatialLayout, _Collectives, _SpatialSplit

# ------------------------------------------------------------------------------------------ generic runner
def test_halo_edge_rows_zero_or_replicate():
    """At the ends of the band order the halo is zeros (default) or copies of the band's edge row."""
    coll = _Collectives(Communicator(None, 1, 0), timeout_s=None)
    x = torch.arange(24.0).view(1, 2, 4, 3)
    (prev, nxt), = coll.halo([x], -2, 2, 1)
    assert prev.shape == (1, 2, 2, 3) and nxt.shape == (1, 2, 1, 3)
    assert not prev.any() and not nxt.any()
    (prev, nxt), = coll.halo([x], -2, 2, 1, edge="replicate")
    assert torch.equal(prev, x[:, :, :1].expand(1, 2, 2, 3)) and torch.equal(nxt, x[:, :, 3:])
    # the replicated rows with the band = F.pad(mode="replicate") of the band (one rank: the whole frame)
    padded = torch.cat([prev, x, nxt], dim=-2)
    assert torch.equal(padded, torch.nn.functional.pad(x, (0, 0, 2, 1), mode="replicate"))
    finish = coll.halo([x], -2, 1, 1, wait=False, edge="replicate")
    assert torch.equal(finish()[0][1], x[:, :, 3:])
    with pytest.raises(ValueError, match=r"halo edge must be one of \['zeros', 'replicate'\]"):
        coll.halo([x], -2, 1, 1, edge="reflect")


def test_replicate_modules_cannot_be_pairs():
    a, b = torch.nn.Conv2d(2, 2, 3, padding=1), torch.nn.Conv2d(2, 2, 3, padding=1)
    root = torch.nn.Sequential(a, b)
    layout = SpatialLayout(root=root, halo=[(a, 1), (b, 1)], pairs=[(a, b)], replicate=[b],
                           unpad=lambda m: (lambda: None))
    split = _SpatialSplit(layout, _Collectives(Communicator(None, 1, 0), timeout_s=None))
    with pytest.raises(ValueError, match="replicate row padding cannot be one of SpatialLayout.pairs"):
        split.install()
    assert "forward" not in root.__dict__  # nothing left installed
