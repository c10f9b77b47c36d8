"""conftest.py for running diffusers' own model tests on boosted models (copy it next to an extracted diffusers tests/).

    git -C <diffusers checkout> archive HEAD tests | tar x -C /tmp/difftests
    cp scripts/diffusers_model_tests_conftest.py /tmp/difftests/conftest.py
    cd /tmp/difftests && LITE_BOOST_DIFFTESTS=1 python -m pytest tests/models/transformers/test_models_transformer_skyreels_v2.py

With LITE_BOOST_DIFFTESTS=1 every test config's ``model_class`` that lite_boost claims (a named family, or the
generic path) becomes a subclass of the same name (and signature) whose constructor boosts the new instance, so
``model_class(**init)`` and ``model_class.from_pretrained(...)`` both give boosted models; a class lite_boost
refuses keeps its stock class (its tests then run stock, and the report says why it was refused). Unset, the same
tests run on stock models. The terminal summary names the path each class takes; with
LITE_BOOST_DIFFTESTS_REPORT=<file.json> the same facts (and which model class each test item exercises) are
written there (scripts/run_diffusers_model_tests.py reads them).
"""
import functools
import json
import os

BOOST = os.environ.get("LITE_BOOST_DIFFTESTS") == "1"
REPORT = os.environ.get("LITE_BOOST_DIFFTESTS_REPORT")
PATHS = {}  # model class name -> path: family name, "generic", or "refused: <why>"
ITEMS = {}  # test node id -> model class name


def claim(cls):
    """The path lite_boost takes for ``cls``, read from the class (no instance): a family name, "generic", or
    "refused: <why>"."""
    from lite_boost.adapter.generic import GENERIC, class_problem
    from lite_boost.registry import SUPPORTED_MODELS, family_of, load_builtin_adapters

    load_builtin_adapters()
    for base in cls.__mro__:
        fn = SUPPORTED_MODELS.get(base.__name__)
        if fn is not None:
            family = family_of(fn)
            return getattr(family, "name", None) or fn.__name__
    why = class_problem(cls)
    return GENERIC if why is None else f"refused: {why}"


@functools.lru_cache(maxsize=None)
def boosted_class(cls):
    import lite_boost

    @functools.wraps(cls.__init__)  # diffusers reads the config arguments from the signature
    def __init__(self, *args, **kwargs):
        cls.__init__(self, *args, **kwargs)
        lite_boost.boost(self)
        PATHS[cls.__name__] = getattr(getattr(self, "_lite_boost").family, "name", "?")

    return type(cls.__name__, (cls,), {"__init__": __init__, "__module__": cls.__module__,
                                        "__qualname__": cls.__qualname__})


def _model_class(klass):
    """(the attribute found on the test class or its bases, the model class it gives) or (None, None)."""
    for base in klass.__mro__:
        if "model_class" in vars(base):
            prop = vars(base)["model_class"]
            break
    else:
        return None, None
    if isinstance(prop, property):
        for obj in (None, klass):  # the testers' property reads nothing of self; a few need an instance
            try:
                value = prop.fget(obj if obj is None else obj())
                break
            except Exception:  # noqa: BLE001 - a tester that cannot be built without pytest's fixtures
                value = None
    else:
        value = prop
    return prop, (value if isinstance(value, type) else None)


def pytest_collection_modifyitems(session, config, items):
    seen = {}
    for item in items:
        klass = getattr(item, "cls", None)
        if klass is None:
            continue
        if klass not in seen:
            prop, orig = _model_class(klass)
            seen[klass] = orig
            if orig is not None:
                path = claim(orig)
                PATHS.setdefault(orig.__name__, path)
                if BOOST and not path.startswith("refused"):
                    klass.model_class = (property(lambda self, c=orig: boosted_class(c)) if isinstance(prop, property)
                                         else boosted_class(orig))
        if seen[klass] is not None:
            ITEMS[item.nodeid] = seen[klass].__name__


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"lite_boost paths ({'boosted' if BOOST else 'stock run'}): {PATHS}")
    if REPORT:
        with open(REPORT, "w") as f:
            json.dump({"boost": BOOST, "paths": PATHS, "items": ITEMS}, f, indent=1, sort_keys=True)
