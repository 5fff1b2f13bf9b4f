"""XLA stage by stage: what ``compile(jit_compile=...)`` means for a PipelineModel.

The same as for Keras, applied per stage: ``"auto"`` compiles a stage with XLA where Keras
would compile a model (the stage on a GPU or TPU, every layer of the stage allowing it),
``True`` every stage that allows it, ``False`` none. A stage placed on a CPU keeps
TensorFlow's kernels under ``"auto"`` although a GPU is visible: Keras chooses XLA for the
accelerator its model runs on, and this stage does not run there. Each stage's functions
(``tf_gpipe.stage``) are then one XLA cluster on its device: a cluster never spans two
stages, so placement holds.
"""

from __future__ import annotations

import warnings
from typing import Any

import tensorflow as tf

from tf_gpipe import keras_compat, tf_compat
from tf_gpipe.cell import Cell

__all__: list[str] = []


def stage_supports_jit(cell: Cell) -> bool:
    """Whether every layer of ``cell`` (nested ones included) allows XLA, as Keras asks of a model."""
    return all(
        getattr(sub, "supports_jit", True)
        for layer in cell.layers
        for sub in keras_compat.nested_layers(layer)
    )


def _on_accelerator(cell: Cell, visible: bool) -> bool:
    """Whether ``cell`` runs on a GPU or TPU: its device's kind, or, with no kind named,
    whether one is ``visible`` (TensorFlow then places it there)."""
    kind = tf.DeviceSpec.from_string(cell.device or "").device_type
    return visible if kind is None else kind.upper() != "CPU"


def choose_jit(cells: list[Cell], jit_compile: Any, run_eagerly: bool = False) -> list[bool]:
    """Decide, stage by stage, what ``compile(jit_compile=...)`` means; set ``cell.jit_compile``.

    ``"auto"``: XLA where Keras would compile a model (the stage is on a GPU or TPU, every
    layer allows it, op determinism is off). ``True``: every stage that allows it,
    with a warning naming the layers of any that does not. ``False``: none.
    """
    visible = any(d.device_type != "CPU" for d in tf.config.list_physical_devices())
    deterministic = tf_compat.op_determinism_enabled()
    choices, refused = [], []
    for cell in cells:
        allowed = stage_supports_jit(cell) and not deterministic
        if jit_compile is True and not allowed:
            refused.append(cell)
        if run_eagerly or jit_compile is False:
            choice = False
        elif jit_compile == "auto":
            choice = _on_accelerator(cell, visible) and allowed
        else:
            choice = allowed
        cell.jit_compile = choice
        cell.run_eagerly = run_eagerly
        choices.append(choice)
    if refused:
        reasons = []
        for cell in refused:
            names = [
                sub.name
                for layer in cell.layers
                for sub in keras_compat.nested_layers(layer)
                if not getattr(sub, "supports_jit", True)
            ]
            reasons.append(f"stage {cell.index}: " + (", ".join(names) or "op determinism is on"))
        warnings.warn(
            f"tf_gpipe: jit_compile=True, but some stages cannot use XLA ({'; '.join(reasons)}); "
            "they run without it, the other stages with it.",
            stacklevel=3,
        )
    return choices
