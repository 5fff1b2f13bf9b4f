"""Turn the fill-drain schedule into TensorFlow ops: forward, then explicit backward."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import tensorflow as tf

from tf_gpipe import checkpoint
from tf_gpipe.cell import Cell
from tf_gpipe.microbatch import Split
from tf_gpipe.schedule import clock_cycles

__all__ = ["Pipeline", "REMAT_MODES"]

REMAT_MODES = ("always", "except_last", "never")


def _accumulate(total, g):
    if g is None:
        return total
    if total is None:
        return g
    if isinstance(total, tf.IndexedSlices) or isinstance(g, tf.IndexedSlices):
        if isinstance(total, tf.IndexedSlices) and isinstance(g, tf.IndexedSlices):
            return tf.IndexedSlices(
                tf.concat([total.values, g.values], 0),
                tf.concat([total.indices, g.indices], 0),
                total.dense_shape,
            )
        return tf.convert_to_tensor(total) + tf.convert_to_tensor(g)
    return total + g


class Pipeline:
    """The cells of a PipelineModel and the fill-drain executor over them.

    Args:
        cells: the stages, in order.
        remat: "always", "except_last" or "never".
    """

    def __init__(self, cells: Sequence[Cell], remat: str):
        self.cells = list(cells)
        self.remat = remat

    def rematerializes(self, k: int) -> bool:
        if self.remat == "always":
            return True
        if self.remat == "except_last":
            return k < len(self.cells) - 1
        return False

    # -- used by __call__: any enclosing tape differentiates through it -------------
    def call(self, split: Split, masks: List[Any], training: Optional[bool]):
        """Forward every micro-batch through every cell; returns per-micro-batch
        ``(outputs, masks)`` and the losses the layers added."""
        M, K = len(split), len(self.cells)
        acts = list(split.chunks)
        masks = list(masks)
        losses: List[tf.Tensor] = []
        for tick in clock_cycles(M, K):
            for m, k in tick:
                cell = self.cells[k]
                with tf.name_scope(f"stage{k}_mb{m}"):
                    if training and self.rematerializes(k):
                        acts[m], masks[m], extra = checkpoint.checkpointed(
                            cell, acts[m], masks[m], training, split.nonempty(m)
                        )
                    else:
                        rec = checkpoint.forward(
                            cell, acts[m], masks[m], training, remat=True, nonempty=split.nonempty(m)
                        )
                        acts[m], masks[m], extra = rec.outputs, rec.out_mask, rec.losses
                losses.extend(extra)
        return acts, masks, losses

    # -- used by train_step: forward, loss on the whole mini-batch, explicit backward --
    def forward(self, split: Split, masks: List[Any], training: bool):
        """Fill: run every (micro-batch, stage) in clock order; keep one Record each."""
        M, K = len(split), len(self.cells)
        records: List[List[Optional[checkpoint.Record]]] = [[None] * K for _ in range(M)]
        acts = list(split.chunks)
        masks = list(masks)
        for tick in clock_cycles(M, K):
            for m, k in tick:
                with tf.name_scope(f"stage{k}_mb{m}"):
                    rec = checkpoint.forward(
                        self.cells[k],
                        acts[m],
                        masks[m],
                        training,
                        remat=self.rematerializes(k),
                        nonempty=split.nonempty(m),
                    )
                records[m][k] = rec
                acts[m], masks[m] = rec.outputs, rec.out_mask
        return records

    def backward(
        self,
        records: List[List[checkpoint.Record]],
        output_grads: List[List[Optional[tf.Tensor]]],
        loss_grads: Dict[Tuple[int, int], List[Optional[tf.Tensor]]],
        training: bool,
    ) -> Dict[int, Optional[tf.Tensor]]:
        """Drain: the forward ticks in reverse; gradients summed per variable on its
        own stage's device. Returns ``{id(variable): gradient}``."""
        M, K = len(records), len(self.cells)
        grads_out = [list(g) for g in output_grads]  # per micro-batch, flat outputs of the current stage
        totals: Dict[int, Optional[tf.Tensor]] = {}
        for tick in reversed(clock_cycles(M, K)):
            for m, k in reversed(tick):
                cell = self.cells[k]
                variables = cell.trainable_variables
                with tf.name_scope(f"stage{k}_mb{m}_backward"):
                    in_grads, var_grads = checkpoint.backward(
                        cell,
                        records[m][k],
                        grads_out[m],
                        loss_grads.get((m, k), []),
                        training,
                        variables,
                        need_input_grads=k > 0,
                    )
                    with tf.device(cell.device):
                        for v, g in zip(variables, var_grads):
                            totals[id(v)] = _accumulate(totals.get(id(v)), g)
                grads_out[m] = in_grads
        return totals
