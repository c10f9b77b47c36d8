"""The model-agnostic adapter layer: one declarative description per model family, shared machinery.

How a target is boosted
=======================

``lite_boost.boost(pipe)`` looks the pipeline's class up in :mod:`lite_boost.registry` (walking its
MRO) and calls the boost function its family registered. That function runs :func:`boost_model` on
every transformer of the pipeline with the family's :class:`ModelFamily`: the family's processor
shim goes on every module matching an attention site, its RoPE module gets the cached fp32 tables,
and ``config.sparse`` / ``config.cache`` install block-sparse attention (:mod:`.sparse`) and
diffusers' step-cache hooks (:mod:`.cache`). ``ParallelManager(pipe)`` (:mod:`lite_boost.api`) does
the same boost, then hands the family's sharding and pipeline plans to :mod:`lite_boost.parallel`,
which executes them with generic hooks and wraps each processor's ``attn_fn`` in Ulysses.

Layering (checked by the import contracts in ``pyproject.toml``): ``lite_boost.models`` (one module
per family: data plus shims) imports this package; this package imports ``parallel``, ``ops``,
``cache``, ``config``; ``parallel`` and ``ops`` import nothing of either; the registry imports
nothing of lite_boost.

How to add a family
===================

The guide (the steps from reading the diffusers model to registering the family, the tests to write, the
pitfalls; worked example ``lite_boost/models/qwenimage.py``) is the documentation page
``docs/models/adding-a-family.md``. In short: one ``ModelFamily`` record (attention sites, RoPE source,
token grid, sharding and pipeline plans, step-cache adapter, quantization patterns) plus a thin processor
shim in ``lite_boost/models/<family>.py``, registered with ``register_family``.
"""

from .boost import BoostState, boost_model, boost_pipeline, unboost_model, unboost_pipeline
from .family import FEATURES, JOINT_LAYOUTS, AttentionSite, ModelFamily, RopeSource, TinyPipeline
from .processor import ROLES, DenseAttention, LiteBoostProcessor, rotate_qk

__all__ = ["AttentionSite", "BoostState", "DenseAttention", "FEATURES", "JOINT_LAYOUTS", "LiteBoostProcessor",
           "ModelFamily", "ROLES", "RopeSource", "TinyPipeline", "boost_model", "boost_pipeline", "rotate_qk", "unboost_model",
           "unboost_pipeline"]
