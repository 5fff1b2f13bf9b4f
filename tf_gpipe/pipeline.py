"""The stages of a PipelineModel and its forward pass through them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tf_gpipe import engine, schedules
from tf_gpipe.batchnorm import DeferredStats
from tf_gpipe.cell import Cell
from tf_gpipe.microbatch import Split

__all__: list[str] = []

REMAT_MODES = ("always", "except_last", "never")


class Pipeline:
    """The cells of a PipelineModel, and which of them are re-materialized.

    Args:
        cells: the stages, in order.
        remat: "always", "except_last" or "never".
    """

    def __init__(self, cells: Sequence[Cell], remat: str, deferred_batch_norm: bool = True):
        self.cells = list(cells)
        self.remat = remat
        self.deferred_batch_norm = deferred_batch_norm

    def deferred_stats(self, training: bool | None) -> DeferredStats | None:
        """A pool for this mini-batch's BatchNormalization moments, if they are deferred."""
        if training and self.deferred_batch_norm and any(c.batch_norms for c in self.cells):
            return DeferredStats()
        return None

    def rematerializes(self, s: int) -> bool:
        if self.remat == "always":
            return True
        if self.remat == "except_last":
            return s < len(self.cells) - 1
        return False

    def call(
        self,
        split: Split,
        masks: list[Any],
        training: bool | None,
        sides: list[Any] | None = None,
        loops: bool | str = False,
    ) -> tuple[list[Any], list[Any], list[list[tf.Tensor]]]:
        """Forward every micro-batch through every cell in fill-drain order.

        Any enclosing tape differentiates through it (re-materializing where
        configured). Returns per-micro-batch outputs and masks, and per
        micro-batch the losses its layers added. Not training, in Keras' test and predict
        steps, a loop over micro-batches where ``loops`` (``micro_batch_loops``) asks for it.
        The order is GPipe's schedule with every cell a stage of its own, whatever
        schedule ``fit`` runs: nothing here runs a backward for another order to interleave.
        """
        schedule = schedules.gpipe(len(self.cells), len(split))
        return engine.run_forward(
            schedule,
            self.cells,
            split,
            masks,
            training,
            self.rematerializes,
            sides,
            self.deferred_stats(training),
            loops,
        )


def check_settings(
    num_micro_batches: Any,
    remat: Any,
    micro_batch_loops: Any,
    schedule: Any,
    virtual_stages: Any,
    num_stages: Any,
) -> None:
    """Refuse ``PipelineModel`` arguments of the wrong kind, or a scope it cannot be made in,
    naming the argument (or scope) and the fix."""
    if isinstance(num_micro_batches, bool) or not isinstance(num_micro_batches, int) or num_micro_batches < 1:
        raise ValueError(
            f"tf_gpipe: num_micro_batches must be an integer >= 1, got {num_micro_batches!r}; "
            "GPipe's bubble is small once num_micro_batches >= 4 * num_stages."
        )
    if remat not in REMAT_MODES:
        raise ValueError(f"tf_gpipe: unknown remat mode {remat!r}; use one of {list(REMAT_MODES)}.")
    if not (isinstance(micro_batch_loops, bool) or micro_batch_loops == "auto"):
        raise ValueError(
            f"tf_gpipe: micro_batch_loops must be True, False or 'auto', got {micro_batch_loops!r}."
        )
    if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise ValueError(f"tf_gpipe: virtual_stages must be an integer >= 1, got {virtual_stages!r}.")
    if num_stages is not None and (
        isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1
    ):
        raise ValueError(f"tf_gpipe: num_stages must be an integer >= 1, got {num_stages!r}.")
    if tf.distribute.has_strategy():  # its variables would be mirrored over its devices, not ours
        raise ValueError(
            f"tf_gpipe: a PipelineModel is being made inside {type(tf.distribute.get_strategy()).__name__}"
            "'s scope. A PipelineModel places each stage's variables and ops on the stage's own "
            "device, which a tf.distribute strategy's variables cannot follow. Make it outside "
            "the scope; for data parallelism over pipelines use "
            "tf_gpipe.cluster.ReplicatedPipeline (docs/cluster.md)."
        )
