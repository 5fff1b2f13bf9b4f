"""One stage of a training step: a cell on its device, its actions on one micro-batch, and
what it keeps between them.

Both ways of building the step drive stages through this one interface, as PyTorch's
schedules drive a ``PipelineStage``: ``engine.run_schedule`` calls a stage once per action
of the schedule, in the schedule's order, and keeps each micro-batch's record here from its
forward to its backward; ``micro_batch_loop`` calls each stage once per loop iteration, with
the record at hand in the same iteration (or held in a TensorList between GPipe's two loops).
For one micro-batch a stage has

* ``forward``: its cell on the micro-batch, re-materialized or taped (``tf_gpipe.cell_pass``);
* ``call``: the same in a forward pass alone, which any enclosing tape may differentiate;
* ``backward``: the input gradients, the weight gradients, or both (a split schedule's B and
  W halves), the weight gradients added to the stage's gradient sums after the previous
  addition (``summed``, the sums' token) where a step built out sums them (M > 1), else
  returned (M = 1; the loops add them to sums of their own);
* ``stash`` and ``unstash``: what a backward reads of its forward, as tensors, and back: what
  GPipe's loop of forwards hands its loop of backwards.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tf_gpipe import cell_pass, handles, ordering, replay, sparse, stage
from tf_gpipe.cell import Cell
from tf_gpipe.microbatch import MicroBatch

__all__: list[str] = []


def layer_loss_grads(weight: Any, n_losses: int) -> list[Any]:
    """What each of the ``n_losses`` losses a stage's layers added in one micro-batch receives
    (the step's ``layer_loss_grads`` of that micro-batch)."""
    if n_losses and weight is None:
        raise ValueError("tf_gpipe: layers added losses: StepLoss needs layer_loss_grads.")
    return [weight] * n_losses


class PipelineStage:
    """One (virtual) stage of a step.

    Args:
        cell: its layers, on their device.
        first: whether it is stage 0 (whose inputs need no gradient).
        rematerialized: its forward keeps only its inputs, and its backward replays it.
        halves: the schedule splits each backward into B (input gradients) and W (weights).
        summing: the weight gradients go into the stage's gradient sums (built out, M > 1),
            not back.
        stashing: a taped forward keeps what its backward reads in tensors (``tf_gpipe.stash``):
            GPipe's loop of forwards, whose backward runs in a later loop.
    """

    def __init__(
        self,
        cell: Cell,
        first: bool,
        rematerialized: bool,
        halves: bool,
        summing: bool,
        stashing: bool = False,
    ) -> None:
        self.cell, self.first, self.rematerialized = cell, first, rematerialized
        self.halves, self.summing, self.stashing = halves, summing, stashing
        # The token of the latest addition to the gradient sums (of their zeroing).
        self.summed: tf.Tensor | None = None
        # What the actions of a step built out keep, per micro-batch: each record from its
        # forward to its backward (to its W, when split), the output gradients sent to it,
        # what a B leaves for its W, and the weight gradients kept apart (M = 1, rows).
        self.records: dict[int, replay.Record] = {}
        self.output_grads: dict[int, list[Any]] = {}
        self.weights_due: dict[int, tuple[replay.Record, Any, list[Any]]] = {}
        self.rows: dict[int, list[Any]] = {}  # id(variable) -> its gradients, per micro-batch
        self.specs: Any = None  # one micro-batch's (inputs, mask, side), as specs
        # Stashing: how the backward half of the taped stage reads what its forward kept.
        self.plan: Any = None
        # The handles of the weights another stage holds, as this stage's calls read them:
        # their copies on its device (``Cell.copied``); gradients are taken w.r.t. these.
        self.copies = {id(w.handle): c.handle for w, c in cell.copied()}

    # ---------------------------------------------------------------- one micro-batch
    def forward(self, mb: MicroBatch, deferred: Any) -> replay.Record:
        """The cell on micro-batch ``mb``, its variable updates applied once; BatchNormalization
        moments pooled into ``deferred`` where given. The record is what its backward reads."""
        with handles.replaced(self.copies):
            return cell_pass.forward(
                self.cell,
                mb,
                self.rematerialized,
                deferred,
                persistent=self.halves,
                input_grads=not self.first,
                stashing=self.stashing,
            )

    def call(self, mb: MicroBatch, deferred: Any) -> tuple[Any, Any, list[tf.Tensor]]:
        """The cell on ``mb`` in a forward pass alone (``__call__``, ``evaluate``, ``predict``):
        ``(outputs, their Keras mask, the losses its layers added)``. Training, an enclosing tape
        may differentiate it: re-materialized where the stage is (``cell_pass.rematerialized``), else
        its taped forward, whose gradient frees each activation once its layer's gradients are
        made (``tf_gpipe.gated``)."""
        if mb.training and self.rematerialized:
            return cell_pass.rematerialized(self.cell, mb, deferred)
        fns = stage.functions(self.cell)
        outputs, out_mask, losses, _ = fns.forward(mb, deferred, taped=bool(mb.training))
        return outputs, out_mask, losses

    def backward(
        self,
        record: replay.Record,
        output_grads: Any,
        loss_grads: list[Any],
        start: list[tf.Tensor],
        inputs: bool = True,
        weights: bool = True,
        tracer: Any = None,
    ) -> tuple[list[Any], list[Any]]:
        """The gradients of one micro-batch's forward (``record``) once ``start`` is ready:
        ``(input gradients, weight gradients)``, the ``inputs`` (never stage 0's) and the
        ``weights`` ones. Summing, the weight gradients are added to the sums after
        ``summed``, which then holds the new token, and only rows (an Embedding's) come back.
        ``tracer``: a timeline's ``(Recorder, device, tag)``."""
        to_sums = self.summing and weights
        part = stage.Part(inputs and not self.first, weights, self.summed if to_sums else None)
        with handles.replaced(self.copies):
            in_grads, result = cell_pass.backward(
                self.cell,
                record,
                ordering.after(start, list(output_grads)),
                ordering.after(start, loss_grads),
                True,
                self.cell.trainable_variables if weights else [],
                part,
                tracer=tracer,
            )
        if to_sums:
            self.summed, result = result
        return in_grads, result

    def weight_half(self, kind: str) -> bool:
        """Whether an action of ``kind`` (``B`` or ``W``) makes the weight gradients."""
        return kind == "W" or not self.halves

    # ---------------------------------------------------------------- gradient sums
    def zero_sums(self) -> tf.Tensor:
        """Zero the gradient sums; ``summed`` is the token, ready once they are."""
        self.summed = stage.functions(self.cell).sums.zero()
        return self.summed

    def read_sums(self) -> dict[int, Any]:
        """``{id(variable): its summed gradient}``, read after the last addition."""
        return stage.functions(self.cell).sums.read(self.summed)

    # ---------------------------------------------------------------- between two loops
    def stash(self, record: replay.Record) -> Any:
        """What the backward of ``record``'s micro-batch reads of it, as tensors a later loop
        can be handed: what the gradient half of a taped stage reads (``tf_gpipe.stash``), or
        the inputs and the state a replay reads."""
        if record.plan is not None:
            self.plan = record.plan
            return list(record.kept or [])
        return (record.inputs, record.mask, record.side, record.before)

    def unstash(self, kept: Any, nonempty: Any, pooled: bool) -> replay.Record:
        """The record ``stash`` handed on, for the backward (``pooled``: its forward pooled
        BatchNormalization moments)."""
        if self.plan is not None:
            return replay.Record(None, None, None, None, [], nonempty=nonempty, kept=kept, plan=self.plan)
        inputs, mask, side, before = kept
        return replay.Record(
            inputs, mask, None, None, [], nonempty=nonempty, side=side, before=before, pooled=pooled
        )

    # ---------------------------------------------------------------- built out
    def due(self, m: int, kind: str, weight: Any) -> tuple[replay.Record, Any, list[Any]]:
        """What micro-batch ``m``'s ``B`` (or ``W``) differentiates: its record, its output
        gradients and the gradients of the losses its layers added (each ``weight``)."""
        if kind == "W":  # what its B received, kept until now
            return self.weights_due.pop(m)
        rec, dy = self.records.pop(m), self.output_grads.pop(m)
        due = (rec, dy, layer_loss_grads(weight, len(rec.losses)))
        if self.halves:
            self.weights_due[m] = due
        return due

    def keep_apart(self, record: replay.Record, weight_grads: list[Any]) -> None:
        """Keep the weight gradients that came back (M = 1, rows), combined by ``totals``."""
        for v, g in zip(self.cell.trainable_variables, weight_grads):
            if g is not None:
                self.rows.setdefault(id(v), []).append(g)
        if self.specs is None:  # specs: an eager step must not keep the tensors alive
            self.specs = sparse.relaxed_specs((record.inputs, record.mask, record.side))

    def totals(self) -> dict[int, Any]:
        """{id(variable): its gradient over the mini-batch} for the stage's variables: the
        gradients kept apart, combined, and the gradient sums read."""
        totals: dict[int, Any] = {}
        if self.specs is not None:
            free: frozenset[int] = frozenset()
            variables = self.cell.trainable_variables
            if any(len(self.rows.get(id(v), [])) > 1 for v in variables):
                free = sparse.batch_free(self.cell, *self.specs)
            with tf.device(self.cell.device):
                for v in variables:
                    if id(v) in self.rows:
                        totals[id(v)] = sparse.combine(self.rows[id(v)], id(v) in free)
        if self.summed is not None:
            totals.update(self.read_sums())
        return totals
