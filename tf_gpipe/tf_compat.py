"""Private TensorFlow APIs tf_gpipe relies on, each behind one small named function.

As ``keras_compat`` does for Keras: a TensorFlow release that moves one fails here,
with a ``TFCompatError`` naming the TensorFlow version and what is gone, and its
test in ``tests/test_tf_compat.py`` fails.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

__all__: list[str] = []


class TFCompatError(RuntimeError):
    """The installed TensorFlow lacks a private API tf_gpipe relies on."""


def _gone(what: str, why: str) -> TFCompatError:
    return TFCompatError(
        f"tf_gpipe: TensorFlow {tf.__version__} no longer provides {what}, which tf_gpipe uses to "
        f"{why}. tf_gpipe is tested with TensorFlow 2.21 (requirements.txt): install "
        "tensorflow==2.21.0, or adapt this hook in tf_gpipe/tf_compat.py (tests/test_tf_compat.py)."
    )


def captured_source(t: Any) -> Any:
    """The outer value a traced function's placeholder ``t`` captures, or None.

    A traced function (``tf.function``, a ``tf.cond`` branch) reads outer tensors and
    variable handles through placeholders that carry no device; where the value lives
    is the outer one's device. Uses ``FuncGraph.captures`` ((outer, inner) pairs).
    """
    graph = getattr(t, "graph", None)
    if graph is None or t.op.type != "Placeholder":
        return None
    captures = getattr(graph, "captures", None)
    if captures is None:
        if type(graph).__name__ == "FuncGraph":
            raise _gone("FuncGraph.captures", "place the optimizer update beside its inputs")
        return None
    for outer, inner in captures:
        if inner is t:
            return outer
    return None


def is_symbolic(t: Any) -> bool:
    """Whether ``t`` is a graph tensor (not an eager one). Uses ``tf.is_symbolic_tensor``."""
    return bool(tf.is_symbolic_tensor(t))


def update_input(op: Any, index: int, tensor: Any) -> None:
    """Make ``op`` read ``tensor`` as its input ``index``, after the op was made.

    A taped stage's gradient loop is made by TensorFlow's gradient code; feeding its
    captured inputs through an identity on the stage's device keeps the lowered loop's
    variables there. Uses ``Operation._update_input``.
    """
    method = getattr(op, "_update_input", None)
    if method is None:
        raise _gone("Operation._update_input", "keep a recurrent stage's gradient loop on its device")
    method(index, tensor)
