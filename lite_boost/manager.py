"""``BoostManager``: MindSpore Lite 2.11's name for ``ParallelManager``, with its YAML schema.

    from lite_boost import BoostManager
    pipe = BoostManager(pipe)                          # patch in place and return the target
    pipe = BoostManager(pipe, config="boost.yaml")
    manager = BoostManager(config={"Parallel": {"dit": {"alg": "CP"}, "vae": {"alg": "DP"}}})
    pipe = manager(pipe)                               # a callable instance; a config given here wins

``config`` is a YAML path, a mapping, a :class:`~lite_boost.config.BoostConfig` (or one of its
sub-configs) or None. Mappings and YAML files take lite_boost's own keys (``parallel``, ``sparse``,
``cache``, ``quant``, ...) or MindSpore Lite's ``Parallel`` section in place of ``parallel``
(:func:`lite_boost.config.parallel_from_boost_manager` maps it): ``dit.alg: CP`` is sequence
parallelism over every rank (Ulysses x Ring degrees if given), ``vae.alg: DP`` the parallel VAE
(exact mode unless ``mode: chunked``), ``world_size`` must equal the launched world size.
"""

from __future__ import annotations

import os
from typing import Any

from .config import BoostConfig, ConfigError

__all__ = ["BoostManager", "load_boost_config"]

_OPTIONS = ("device", "init_method", "mesh", "move_to_device")  # keyword options passed on to ParallelManager


def load_boost_config(config: Any) -> BoostConfig:
    """A BoostConfig from a YAML path, a mapping (either schema), a (sub-)config or None."""
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if not os.path.isfile(path):
            raise ConfigError(f"config must be a YAML file path, a mapping, a BoostConfig or None; no file at {path!r}")
        return BoostConfig.from_yaml(path)
    return BoostConfig.coerce(config)


class BoostManager:
    """Patch a supported pipeline or transformer in place for (parallel) inference; returns the target.

    ``BoostManager(target, config)`` = ``ParallelManager(target, config)`` (at world size 1 =
    ``lite_boost.boost``); ``BoostManager(config=...)`` without a target returns a manager whose call
    ``manager(target, config=None)`` does the same. Keyword options (``mesh``, ``init_method``,
    ``device``, ``move_to_device``) go to :func:`lite_boost.api.ParallelManager`. Every check (config
    keys, world size, family features) runs before any collective.
    """

    def __new__(cls, target=None, config=None, **options):
        if target is None:
            return super().__new__(cls)
        return cls._apply(target, load_boost_config(config), options)

    def __init__(self, target=None, config=None, **options):  # reached only without a target
        self.config = load_boost_config(config)
        self.options = options

    def __call__(self, target, config=None, **options):
        if target is None:
            raise TypeError("BoostManager(...)(target): target must be a supported pipeline or model, got None")
        cfg = self.config if config is None else load_boost_config(config)
        return self._apply(target, cfg, {**self.options, **options})

    @staticmethod
    def _apply(target, config: BoostConfig, options: dict):
        from .api import apply_parallel_plan
        from .plan import make_plan

        unknown = sorted(set(options) - set(_OPTIONS))
        if unknown:
            raise TypeError(f"BoostManager got unknown option(s) {unknown}; options: {list(_OPTIONS)}")
        options = dict(options)
        init_method = options.pop("init_method", None)
        plan = make_plan(target, config, parallel=True, **options)  # world size, family, features: once
        return apply_parallel_plan(target, plan, init_method=init_method)

    def __repr__(self) -> str:
        return f"BoostManager(config={self.config!r})"
