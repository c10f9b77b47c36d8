"""Per-family adapters: each module describes one diffusers model family for the adapter layer.

Importing this package registers the built-in families in :mod:`lite_boost.registry` (which
``boost`` / ``ParallelManager`` look targets up in). The registry names are re-exported here:
``SUPPORTED_MODELS`` maps a class name to its boost function; lookup walks the target's class
hierarchy, so user subclasses of a supported class work too. How to add a family:
:mod:`lite_boost.adapter` (the Qwen-Image adapter, ``qwenimage.py``, is the worked example).
"""

from __future__ import annotations

from ..registry import (SUPPORTED_MODELS, UnsupportedModelError, families, lookup, register_family, register_model,
                        supported_model_names)

__all__ = ["SUPPORTED_MODELS", "UnsupportedModelError", "register_model", "register_family", "lookup",
           "supported_model_names", "families"]

from . import wan  # noqa: E402,F401  (registers the Wan family)
from . import wan_vae  # noqa: E402,F401  (registers the Wan parallel-VAE adapter)
from . import qwenimage  # noqa: E402,F401  (registers the Qwen-Image family)
from . import qwenimage21  # noqa: E402,F401  (registers the Qwen-Image 2.1 family)
from . import flux  # noqa: E402,F401  (registers the Flux.1 family)
from . import flux2  # noqa: E402,F401  (registers the Flux.2 family)
from . import flux_vae  # noqa: E402,F401  (registers the Flux.1 / Flux.2 parallel-VAE adapter)
from . import ltx  # noqa: E402,F401  (registers the LTX-Video family)
from . import ltx_vae  # noqa: E402,F401  (registers the LTX-Video parallel-VAE adapter)
from . import ltx2  # noqa: E402,F401  (registers the LTX-2 family)
from . import ltx2_vae  # noqa: E402,F401  (registers the LTX-2 parallel-VAE adapter)
from . import cogvideox  # noqa: E402,F401  (registers the CogVideoX family)
from . import hunyuan_video  # noqa: E402,F401  (registers the HunyuanVideo and HunyuanVideo-1.5 families)
from . import hunyuan_video15_vae  # noqa: E402,F401  (registers the HunyuanVideo-1.5 parallel-VAE adapter)
from . import chronoedit  # noqa: E402,F401  (registers the ChronoEdit family)
from . import skyreels_v2  # noqa: E402,F401  (registers the SkyReels-V2 family)
from . import wan_vace  # noqa: E402,F401  (registers the Wan VACE family)
from . import wan_animate  # noqa: E402,F401  (registers the Wan Animate family)
from . import minimax_h3  # noqa: E402,F401  (registers the MiniMax-H3 family)
from . import minimax_h3_vae  # noqa: E402,F401  (registers the MiniMax-H3 parallel-VAE adapter)
