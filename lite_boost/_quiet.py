"""Narrow log filters for dependency notices that say nothing actionable to a lite_boost user.

Installed once by ``import lite_boost``. Each filter sits on the one logger that emits the notice and drops
only records matching that notice; every other record of those loggers passes unchanged. What is dropped:

- ``torchao``: "Failed to load .../torchao/_C*.so" for each compiled extension a build of torch cannot load
  (the CUDA / MX kernels on a CPU-only torch). torchao works without them for what lite_boost uses.
- ``torch.utils._pytree``: "<enum ...> is an Enum subclass and is now natively supported by torch.compile"
  for torchao's enums (torchao 0.18 still registers them as pytree constants; torch 2.13 deprecates that).
  Only records whose enum comes from torchao are dropped.
- ``diffusers.quantizers.torchao.torchao_quantizer``: "Unable to import `torchao` Tensor objects" (diffusers
  0.42 looks for tensor classes torchao 0.18 renamed; it concerns loading torchao-serialized checkpoints,
  which lite_boost does not do).
- ``transformers.utils.import_utils``: "`CLIPImageProcessor` requires torchvision (not installed); falling
  back to `CLIPImageProcessorPil`" (diffusers' Wan image-to-video pipeline imports the torchvision name;
  the PIL processor it falls back to is the one the pipeline has always used).

``lite-boost generate -v`` (or ``LITE_BOOST_SHOW_DEPENDENCY_NOTICES=1``) leaves them in.
"""

from __future__ import annotations

import logging
import os

__all__ = ["install", "uninstall", "FILTERS"]


class _DropMatching(logging.Filter):
    def __init__(self, name: str, test):
        super().__init__()
        self.logger_name = name
        self.test = test

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            return not self.test(record)
        except Exception:  # noqa: BLE001 - a record we do not understand is never dropped
            return True


def _torchao_extension(record) -> bool:
    msg = record.getMessage()
    return msg.startswith("Failed to load ") and "torchao" in msg and "_C" in msg


def _torchao_enum(record) -> bool:
    cls = record.args[0] if isinstance(record.args, tuple) and record.args else None
    return ("is an Enum subclass and is now natively supported" in str(record.msg)
            and str(getattr(cls, "__module__", "")).startswith("torchao"))


def _torchao_tensor_objects(record) -> bool:
    return record.getMessage().startswith("Unable to import `torchao` Tensor objects")


def _clip_torchvision(record) -> bool:
    msg = record.getMessage()
    return "requires torchvision (not installed); falling back to" in msg and "ImageProcessor" in msg


FILTERS = {
    "torchao": _torchao_extension,
    "torch.utils._pytree": _torchao_enum,
    "diffusers.quantizers.torchao.torchao_quantizer": _torchao_tensor_objects,
    "transformers.utils.import_utils": _clip_torchvision,
}


def _installed(logger: logging.Logger):
    return [f for f in logger.filters if isinstance(f, _DropMatching)]


def install() -> None:
    """Attach the filters (idempotent); a no-op when LITE_BOOST_SHOW_DEPENDENCY_NOTICES is set."""
    if os.environ.get("LITE_BOOST_SHOW_DEPENDENCY_NOTICES"):
        return
    for name, test in FILTERS.items():
        logger = logging.getLogger(name)
        if not _installed(logger):
            logger.addFilter(_DropMatching(name, test))


def uninstall() -> None:
    """Remove the filters again (``lite-boost generate -v`` shows every dependency notice)."""
    for name in FILTERS:
        logger = logging.getLogger(name)
        for f in _installed(logger):
            logger.removeFilter(f)
