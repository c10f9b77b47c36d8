import pytest
import torch

import lite_boost
from lite_boost.config import ConfigError
from lite_boost.models import SUPPORTED_MODELS, UnsupportedModelError, lookup, register_model
from lite_boost.models.wan import boost_wan_pipeline, boost_wan_transformer


def test_wan_classes_are_registered():
    assert SUPPORTED_MODELS["WanTransformer3DModel"] is boost_wan_transformer
    assert SUPPORTED_MODELS["WanPipeline"] is boost_wan_pipeline
    assert SUPPORTED_MODELS["WanImageToVideoPipeline"] is boost_wan_pipeline


def test_lookup_walks_the_class_hierarchy():
    from diffusers import WanPipeline

    class MyWan(WanPipeline):
        pass

    assert lookup(MyWan.__new__(MyWan)) is boost_wan_pipeline


def test_unknown_class_lists_supported_names():
    with pytest.raises(UnsupportedModelError) as info:
        lite_boost.boost(torch.nn.Linear(2, 2))
    msg = str(info.value)
    assert "no adapter for Linear" in msg
    for name in ("WanImageToVideoPipeline", "WanPipeline", "WanTransformer3DModel"):
        assert name in msg


def test_bad_config_fails_before_the_model_is_touched():
    from lite_boost.demo import tiny_wan_transformer

    model = tiny_wan_transformer()
    with pytest.raises(ConfigError, match="unknown BoostConfig key"):
        lite_boost.boost(model, {"sparsity": 0.5})
    assert not hasattr(model, "_lite_boost")
    assert type(model.blocks[0].attn1.processor).__name__ == "WanAttnProcessor"


def test_register_model_decorator():
    @register_model("_LiteBoostTestModel")
    def boost_test(target, config):
        target.boosted_with = config
        return target

    try:
        class _LiteBoostTestModel:
            pass

        obj = _LiteBoostTestModel()
        assert lite_boost.boost(obj) is obj and obj.boosted_with == lite_boost.BoostConfig()
        with pytest.raises(ValueError, match="already registered"):
            register_model("_LiteBoostTestModel")(lambda t, c: t)
        with pytest.raises(ValueError, match="one or more class names"):
            register_model()
    finally:
        SUPPORTED_MODELS.pop("_LiteBoostTestModel", None)
