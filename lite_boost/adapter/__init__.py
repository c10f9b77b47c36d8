"""The model-agnostic adapter layer (developer guide below; a placeholder until written)."""

from .boost import BoostState, boost_model, boost_pipeline, unboost_model, unboost_pipeline
from .family import FEATURES, JOINT_LAYOUTS, AttentionSite, ModelFamily, RopeSource
from .processor import ROLES, DenseAttention, LiteBoostProcessor, rotate_qk

__all__ = ["AttentionSite", "BoostState", "DenseAttention", "FEATURES", "JOINT_LAYOUTS", "LiteBoostProcessor",
           "ModelFamily", "ROLES", "RopeSource", "boost_model", "boost_pipeline", "rotate_qk", "unboost_model",
           "unboost_pipeline"]
