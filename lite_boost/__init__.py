"""lite_boost: make diffusers diffusion transformers (video and image) faster without changing their output.

    import lite_boost
    pipe = lite_boost.boost(pipe)                     # one process
    from lite_boost.parallel import ParallelManager
    pipe = ParallelManager(pipe)                      # under torchrun: sequence / CFG parallel
    pipe = lite_boost.BoostManager(pipe, config="boost.yaml")   # MindSpore Lite 2.11's name and YAML schema
"""

from . import _quiet
from .config import BoostConfig, CacheConfig, ConfigError, ParallelConfig, QuantConfig, SparseConfig

_quiet.install()  # drops a few dependency notices, each matched narrowly (see lite_boost/_quiet.py)

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "BoostConfig",
    "CacheConfig",
    "ConfigError",
    "ParallelConfig",
    "QuantConfig",
    "SparseConfig",
    "boost",
    "unboost",
    "ParallelManager",
    "BoostManager",
]


def __getattr__(name):  # keep `import lite_boost` light: diffusers is imported on first use
    if name in ("boost", "unboost", "ParallelManager"):
        from . import api

        return getattr(api, name)
    if name == "BoostManager":
        from .manager import BoostManager

        return BoostManager
    raise AttributeError(f"module 'lite_boost' has no attribute {name!r}")
