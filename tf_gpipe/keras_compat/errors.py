"""``KerasCompatError`` and the readers of private Keras attributes and modules that raise it."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import keras

__all__: list[str] = []


class KerasCompatError(RuntimeError):
    """The installed Keras lacks a private API tf_gpipe relies on."""


def gone(what: str, why: str) -> KerasCompatError:
    """The error for ``what`` missing from the installed Keras, which tf_gpipe uses to ``why``."""
    return KerasCompatError(
        f"tf_gpipe: Keras {keras.__version__} no longer provides {what}, which tf_gpipe uses to "
        f"{why}. tf_gpipe is tested with Keras 3.15 (requirements.txt) and 3.16: install keras==3.15.1, or "
        "adapt this hook in tf_gpipe/keras_compat/ (tests/test_keras_compat.py checks each one)."
    )


def private_attribute(obj: Any, name: str, why: str) -> Any:
    """``obj.name``, or ``KerasCompatError`` naming it if this Keras has no such attribute."""
    try:
        return getattr(obj, name)
    except AttributeError as e:
        owner = obj.__name__ if isinstance(obj, (ModuleType, type)) else type(obj).__name__
        raise gone(f"{owner}.{name}", why) from e


def private_module(name: str, why: str) -> ModuleType:
    """The Keras module ``name``, or ``KerasCompatError`` naming it if this Keras has none."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise gone(f"the module {name}", why) from e
