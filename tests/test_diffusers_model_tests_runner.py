"""scripts/run_diffusers_model_tests.py and its conftest: which path each class takes, the boosting model_class,
and the per-test comparison of a stock and a boosted run (junit XML written here, no diffusers test run)."""

from __future__ import annotations

import importlib.util
import inspect
import json
from pathlib import Path

import torch

from lite_boost.api import is_boosted

ROOT = Path(__file__).resolve().parent.parent


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_claim_names_family_generic_and_refusal():
    from diffusers import FluxTransformer2DModel, TransformerTemporalModel, ZImageTransformer2DModel

    conf = _load("difftests_conftest", ROOT / "scripts" / "diffusers_model_tests_conftest.py")
    assert conf.claim(FluxTransformer2DModel) == "flux"
    assert conf.claim(ZImageTransformer2DModel) == "generic"
    why = conf.claim(TransformerTemporalModel)
    assert why.startswith("refused: ") and "dispatch_attention_fn" in why


@torch.no_grad()
def test_boosted_class_keeps_signature_and_matches_stock():
    from diffusers import FluxTransformer2DModel

    conf = _load("difftests_conftest", ROOT / "scripts" / "diffusers_model_tests_conftest.py")
    cls = conf.boosted_class(FluxTransformer2DModel)
    assert cls.__name__ == "FluxTransformer2DModel" and issubclass(cls, FluxTransformer2DModel)
    assert inspect.signature(cls.__init__) == inspect.signature(FluxTransformer2DModel.__init__)
    init = dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
                num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8])
    torch.manual_seed(0)
    stock = FluxTransformer2DModel(**init).eval()
    torch.manual_seed(0)
    boosted = cls(**init).eval()
    assert is_boosted(boosted) and not is_boosted(stock)
    assert conf.PATHS["FluxTransformer2DModel"] == "flux"
    g = torch.Generator().manual_seed(0)
    kw = dict(hidden_states=torch.randn(1, 16, 4, generator=g), encoder_hidden_states=torch.randn(1, 8, 32, generator=g),
              pooled_projections=torch.randn(1, 32, generator=g), img_ids=torch.randn(16, 3, generator=g),
              txt_ids=torch.randn(8, 3, generator=g), timestep=torch.tensor([1.0]))
    torch.testing.assert_close(boosted(**kw).sample, stock(**kw).sample, rtol=0, atol=1e-5)


_XML = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.models.transformers.test_models_transformer_x.TestX" name="test_a" />
<testcase classname="tests.models.transformers.test_models_transformer_x.TestX" name="test_b">{b}</testcase>
<testcase classname="tests.models.transformers.test_models_transformer_x.TestX" name="test_c">
<skipped message="needs an accelerator" /></testcase>
</testsuite></testsuites>"""


def test_runner_reports_regressions_per_class(tmp_path):
    run = _load("run_diffusers_model_tests", ROOT / "scripts" / "run_diffusers_model_tests.py")
    node = "tests/models/transformers/test_models_transformer_x.py::TestX::"
    (tmp_path / "tests").mkdir()
    out = tmp_path / "out"
    for mode, b in (("stock", ""), ("boosted", '<failure message="AssertionError: outputs differ">trace</failure>')):
        (out / mode).mkdir(parents=True)
        (out / mode / "test_models_transformer_x.xml").write_text(_XML.format(b=b))
        report = {"paths": {"XModel": "generic"}, "items": {node + t: "XModel" for t in ("test_a", "test_b", "test_c")}}
        (out / mode / "test_models_transformer_x.json").write_text(json.dumps(report))
    assert run.outcomes(str(out / "boosted" / "test_models_transformer_x.xml"))[node + "test_b"] == \
        ("failed", "AssertionError: outputs differ")
    files = [str(tmp_path / "tests/models/transformers/test_models_transformer_x.py")]

    class Args:
        pass

    args = Args()
    args.out = str(out)
    row = run.collect(args, files)["XModel"]
    assert (row["path"], row["tests"], row["stock"], row["boosted"]) == ("generic", 3, 2, 1)
    assert row["regressions"] == [(node + "test_b", "failed", "AssertionError: outputs differ")]
    text = run.table(run.collect(args, files))
    assert "| XModel | generic | 3 | 2 | 1 | `TestX::test_b` (failed: AssertionError: outputs differ) |" in text
    assert "| 3 | 2 | 1 | 1 (0 refusals, 1 other) |" in text
