"""conftest.py for running diffusers' own model tests on boosted models (copy it next to an extracted diffusers tests/).

    git -C <diffusers checkout> archive HEAD tests | tar x -C /tmp/difftests
    cp scripts/diffusers_model_tests_conftest.py /tmp/difftests/conftest.py
    cd /tmp/difftests && LITE_BOOST_DIFFTESTS=1 python -m pytest tests/models/transformers/test_models_transformer_skyreels_v2.py

With LITE_BOOST_DIFFTESTS=1 every test config's ``model_class`` becomes a subclass of the same name (and signature)
whose constructor boosts the new instance, so ``model_class(**init)`` and ``model_class.from_pretrained(...)``
both give boosted models; unset, the same tests run on stock models. The summary names the path each class took.
"""
import functools
import os

import pytest

BOOST = os.environ.get("LITE_BOOST_DIFFTESTS") == "1"
PATHS = {}


@functools.lru_cache(maxsize=None)
def boosted_class(cls):
    import lite_boost

    @functools.wraps(cls.__init__)  # diffusers reads the config arguments from the signature
    def __init__(self, *args, **kwargs):
        cls.__init__(self, *args, **kwargs)
        lite_boost.boost(self)
        PATHS[cls.__name__] = type(getattr(self, "_lite_boost").family).__name__

    return type(cls.__name__, (cls,), {"__init__": __init__, "__module__": cls.__module__,
                                        "__qualname__": cls.__qualname__})


def pytest_collection_modifyitems(session, config, items):
    if not BOOST:
        return
    seen = set()
    for item in items:
        klass = getattr(item, "cls", None)
        if klass is None or klass in seen:
            continue
        seen.add(klass)
        prop = None
        for base in klass.__mro__:
            if "model_class" in vars(base):
                prop = vars(base)["model_class"]
                break
        if prop is None:
            continue
        orig = prop.fget(None) if isinstance(prop, property) else prop
        try:
            orig = prop.fget(klass()) if isinstance(prop, property) else prop
        except Exception:
            pass
        if isinstance(orig, type):
            klass.model_class = property(lambda self, c=orig: boosted_class(c)) if isinstance(prop, property) \
                else boosted_class(orig)


def pytest_terminal_summary(terminalreporter):
    if BOOST:
        terminalreporter.write_line(f"lite_boost paths: {PATHS}")
