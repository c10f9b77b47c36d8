"""lite_boost: make diffusers video diffusion transformers faster without changing their output.

    import lite_boost
    pipe = lite_boost.boost(pipe)                     # one process
    from lite_boost.parallel import ParallelManager
    pipe = ParallelManager(pipe)                      # under torchrun: sequence / CFG parallel
"""

from .config import BoostConfig, CacheConfig, ConfigError, ParallelConfig, QuantConfig, SparseConfig

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
]


def __getattr__(name):  # keep `import lite_boost` light: diffusers is imported on first use
    if name in ("boost", "unboost"):
        from . import api

        return getattr(api, name)
    if name == "ParallelManager":
        from .parallel import ParallelManager

        return ParallelManager
    raise AttributeError(f"module 'lite_boost' has no attribute {name!r}")
