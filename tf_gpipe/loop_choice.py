"""Which steps and forward passes are built as loops over micro-batches
(``tf_gpipe.micro_batch_loop``), and which one call per action (``tf_gpipe.engine``).

The loops need a graph being built, two or more micro-batches of dense tensors, an order
each device can keep across micro-batches, and, where a user's tape differentiates the
forward, stages whose gradient a loop's gradient can carry (``taped_applies``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf

from tf_gpipe import keras_compat, scoped, stage
from tf_gpipe.cell import Cell
from tf_gpipe.microbatch import Split
from tf_gpipe.schedules import loop_waits

__all__: list[str] = []


def chosen(setting: bool | str) -> bool:
    """Whether ``PipelineModel(micro_batch_loops=setting)`` asks for the loops.

    ``"auto"`` and ``True`` do, on every kind of device; ``False`` builds every action
    out, one call per (stage, micro-batch): a graph, and a first step, that grow with M.
    """
    return setting is True or setting == "auto"


def applies(
    schedule: Any,
    cells: Sequence[Cell],
    split: Split,
    masks: Sequence[Any],
    rematerializes: Callable[[int], bool],
    sides: Sequence[Any] | None,
    targets: Sequence[Any] | None,
    per_micro_batch: bool,
    tracer: Any,
) -> bool:
    """Whether ``micro_batch_loop.run`` builds this step (else every action is built out)."""
    if tracer is not None or not loopable(cells, split, (masks, sides, targets)):
        return False
    taped = [c for s, c in enumerate(cells) if not rematerializes(s)]
    if not per_micro_batch and any(stage.runs_loops(c) for c in taped):
        # Between GPipe's two loops a taped stage keeps what its gradient reads
        # (``tf_gpipe.stash``): a recurrent layer's per-step stacks are no tensors a
        # TensorArray holds.
        return False
    try:
        waits = loop_waits.waits(schedule)
    except ValueError:
        return False
    # A forward waiting for a backward needs both in one loop.
    return per_micro_batch or not any(w.kind == "F" and w.on_kind != "F" for w in waits)


def loopable(cells: Sequence[Cell], split: Split, per_micro_batch_data: Any) -> bool:
    """Whether these micro-batches can go through a loop at all: a graph being built, two
    or more micro-batches, no stage run eagerly, and only dense tensors (what TensorArrays
    hold: no SparseTensor or RaggedTensor)."""
    if tf.executing_eagerly() or len(split) < 2 or any(getattr(c, "run_eagerly", False) for c in cells):
        return False
    leaves = tf.nest.flatten((split.chunks, [list(d or []) for d in per_micro_batch_data]))
    return all(t is None or isinstance(t, tf.Tensor) for t in leaves)


_untaped = scoped.Flag()


def untaped() -> contextlib.AbstractContextManager[None]:
    """Within this scope nothing differentiates the model's forward (Keras' test and predict
    steps), so ``micro_batch_loop.forward`` may build it as a loop of plain stage calls;
    under a user's tape it needs re-materialized ones (``taped_applies``)."""
    return _untaped.scope()


def forward_applies(
    cells: Sequence[Cell], split: Split, masks: Sequence[Any], sides: Sequence[Any] | None
) -> bool:
    """Whether ``micro_batch_loop.forward`` builds this forward pass (else each micro-batch
    is built out)."""
    return bool(_untaped) and loopable(cells, split, (masks, sides))


def taped_applies(
    cells: Sequence[Cell],
    split: Split,
    masks: Sequence[Any],
    sides: Sequence[Any] | None,
    rematerializes: Callable[[int], bool],
) -> bool:
    """Whether ``micro_batch_loop.forward(..., taped=True)`` builds ``__call__``'s training
    forward, which a user's tape may differentiate: every stage re-materialized, none
    running a recurrent layer's loop or holding an Embedding.

    A stage that keeps its activations, differentiated through a loop, keeps them in the
    loop's accumulators on top (measured 1.39x plain Keras' peak, against under 1.2x built
    out, ``tests/test_guarantees.py``). TensorFlow sums a loop's gradients of a variable
    densely: an Embedding's gradient would come out as a whole table, not its rows.
    """
    if not loopable(cells, split, (masks, sides)):
        return False
    return all(rematerializes(s) and not stage.runs_loops(c) and not _embeds(c) for s, c in enumerate(cells))


def _embeds(cell: Cell) -> bool:
    return any(
        isinstance(sub, keras.layers.Embedding)
        for layer in cell.layers
        for sub in keras_compat.nested_layers(layer)
    )
