"""docs/api.md names every public name of tf_gpipe, and only names that exist.

Public: ``tf_gpipe.__all__``, the ``__all__`` of each public module, and
``PipelineModel``'s constructor and ``from_model`` arguments, its own methods and
properties, and the attributes its constructor sets. A name added to the code without
a line in docs/api.md fails here, as does a documented function that no longer exists.
"""

import importlib
import inspect
import pathlib
import re

import keras
import pytest

import tf_gpipe

API_MD = pathlib.Path(__file__).resolve().parent.parent / "docs" / "api.md"
# The modules docs/api.md documents name by name; the others are internal.
PUBLIC_MODULES = ["schedules", "timeline", "flags", "balance", "cluster"]


def _sections():
    """``{"tf_gpipe.X": text}`` for every ``## `tf_gpipe.X` `` section of docs/api.md."""
    parts = re.split(r"^## `([^`]+)`\s*$", API_MD.read_text(encoding="utf-8"), flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def _mentioned(name, text):
    """``name`` appears as a whole word inside some `code span` of ``text``."""
    prose = re.sub(r"^\s*```.*?^\s*```", "", text, flags=re.M | re.S)  # code blocks are examples
    return any(re.search(rf"(?<!\w){re.escape(name)}(?!\w)", s) for s in re.findall(r"`([^`]+)`", prose))


def _missing(names, text):
    return sorted(n for n in names if not _mentioned(n, text))


def _documented_calls(text):
    """The ``name`` of every bullet that documents a call: "* `name(" or "* `A.b(".."""
    return re.findall(r"^\s*[*-] `([A-Za-z_][\w.]*)\(", text, flags=re.M)


def _resolve(obj, dotted):
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def test_every_top_level_export_has_a_section():
    sections = _sections()
    missing = [n for n in tf_gpipe.__all__ if f"tf_gpipe.{n}" not in sections]
    assert not missing, f"docs/api.md has no '## `tf_gpipe.NAME`' section for {missing}"


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_every_name_of_a_public_module_is_documented(module_name):
    module = importlib.import_module(f"tf_gpipe.{module_name}")
    text = _sections().get(f"tf_gpipe.{module_name}")
    assert text is not None, f"docs/api.md has no section for tf_gpipe.{module_name}"
    missing = _missing(module.__all__, text)
    assert not missing, f"tf_gpipe.{module_name}.__all__ names missing from docs/api.md: {missing}"


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_documented_functions_exist(module_name):
    module = importlib.import_module(f"tf_gpipe.{module_name}")
    text = _sections()[f"tf_gpipe.{module_name}"]
    # A method may be listed under its class's paragraph without the class name.
    owners = [module] + [getattr(module, n) for n in module.__all__ if inspect.isclass(getattr(module, n))]
    stale = [n for n in _documented_calls(text) if not any(callable(_resolve_or_none(o, n)) for o in owners)]
    assert not stale, f"docs/api.md documents tf_gpipe.{module_name} calls that do not exist: {stale}"


def _resolve_or_none(obj, dotted):
    try:
        return _resolve(obj, dotted)
    except AttributeError:
        return None


def _pipeline_model_public_names():
    PM = tf_gpipe.PipelineModel
    args = set(inspect.signature(PM.__init__).parameters) | set(inspect.signature(PM.from_model).parameters)
    args -= {"self", "kwargs"}
    members = {n for n in vars(PM) if not n.startswith("_")}
    # Attributes the constructor sets beyond what any Keras model has.
    keras_attributes = set(vars(keras.Sequential([keras.layers.Dense(1)]))) | set(vars(keras.Model()))
    pm = PM([keras.layers.Dense(1)])
    attributes = {n for n in vars(pm) if not n.startswith("_") and n not in keras_attributes}
    return args | members | attributes


def test_pipeline_model_arguments_methods_and_attributes_are_documented():
    names = _pipeline_model_public_names()
    assert {"side_inputs", "from_model", "to_sequential", "stage_layers"} <= names  # the probe sees them
    missing = _missing(names, _sections()["tf_gpipe.PipelineModel"])
    assert not missing, f"PipelineModel names missing from docs/api.md: {missing}"


def test_pipeline_model_documented_methods_exist():
    text = _sections()["tf_gpipe.PipelineModel"]
    calls = [n for n in _documented_calls(text) if not n.startswith(("keras.", "tf."))]
    stale = [n for n in calls if _resolve_or_none(tf_gpipe.PipelineModel, n) is None]
    assert not stale, f"docs/api.md documents PipelineModel members that do not exist: {stale}"
