"""A training step as loops over micro-batches: a graph, and a first step, flat in M.

Built out, a step holds one stage-function call per action: O(K x M) call ops, and
TensorFlow instantiates and optimizes a stateful function's body once per call site, so
the first step grows with M (benchmarks/first_step/README.md). Here the step is a
``tf.while_loop`` whose iteration ``m`` runs micro-batch ``m``'s actions, as many stage
calls as one micro-batch needs, whatever M, each inlined (``stage.inlined``):

* a schedule whose loss is per micro-batch (1F1B, interleaved, ZB-H1; any remat mode): one
  loop, ``F(m)@s0 ─► ... ─► F(m)@s_last ─► loss(m) ─► B(m)@s_last ─► ... ─► B(m)@s0``;
  ZB-H1 runs stage s's W(m) after B(m + j): the loop runs it in iteration m + j
  (``loop_waits.weight_lags``; the last ones in iterations that skip the rest,
  ``loop_guard``), what it reads held until then, where it would otherwise take the
  device from B(m + 1) (benchmarks/plan/README.md);
* GPipe, whose loss sees the whole mini-batch: a loop of forwards, the loss, a loop of
  backwards. What a backward needs of its forward waits in TensorLists on the stage's
  device, freed once read: a re-materialized stage's inputs, mask, side inputs and the
  state it read, or what the gradient of a taped stage reads (``tf_gpipe.stash``).

Every iteration may run at once (``parallel_iterations``): what overlaps micro-batches
across stages is dataflow. What holds each device to its schedule is
``schedules.loop_waits``: each action waits for the actions of its device that the
schedule puts before it in its own or an earlier micro-batch (``F(m)@s`` after
``B(m - K + s)@s`` in 1F1B: at most K - s micro-batches in flight), their tokens travelling
as loop variables. Each stage's actions of one kind run in micro-batch order (a forward
reads what the previous one wrote: random draws, statistics; a backward adds to the
running gradient sums the previous one left), so the step computes what the built-out one
does.

A stage that keeps its activations (``remat="never"``) runs its taped forward and its
gradient in one iteration: the tape never leaves the loop body, and the K - s
micro-batches a 1F1B stage holds are the iterations in flight.

What leaves an iteration (outputs, layer losses, loss terms, weight gradients (summed)
and gradient rows, BatchNormalization moments, a GPipe stage's stash) has a structure known
once the body is traced; ``loop_state.emitting`` traces it once more for it, into a graph
never run and without automatic control dependencies (``tf_compat.traced_unordered``): the
stage functions' traces are shared, so that costs the glue only. The metric updates a
micro-batch's loss makes leave it too, as their arguments: the step makes them after the
loop, in micro-batch order (``keras_compat.recorded_metric_updates``).

Each stage's forward and backward of one micro-batch are those of ``engine``'s built-out
step (``pipeline_stage.PipelineStage``), and the stage says what a backward reads of its
forward (``stash``); the loops carry, as loop variables, what a built-out stage keeps
between its actions: GPipe's stash, and each stage's gradient sums (built out, variables
added to inside the backward, ``tf_gpipe.gradient_sums``; here running sums that exist only
while the step runs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import tensorflow as tf

from tf_gpipe import loop_loss, loop_state, ordering, replay, sparse, stage
from tf_gpipe.batchnorm import DeferredStats
from tf_gpipe.cell import Cell
from tf_gpipe.microbatch import MicroBatch, Split
from tf_gpipe.pipeline_stage import PipelineStage, layer_loss_grads
from tf_gpipe.schedules import loop_waits

__all__: list[str] = []

# Given a micro-batch's last-stage outputs, their mask and its target (the trainer's),
# the gradients of its loss w.r.t. the outputs and the terms to sum over micro-batches.
MicroLossFn = Callable[[Any, Any, Any], tuple[list[tf.Tensor | None], list[tf.Tensor | None]]]
# Given every micro-batch's last-stage outputs and masks, each one's loss gradients.
BatchLossFn = Callable[[list[Any], list[Any]], list[list[tf.Tensor | None]]]


class StepLoss(NamedTuple):
    """How a training step's loss reaches its stages: either the whole mini-batch's loss once
    every forward is done (fill-drain schedules only), or a loss per micro-batch right after
    its last forward. Both get the Keras masks of the outputs: a loss over padded sequences
    needs them.

    Attributes:
        batch_loss: given the last stage's outputs of every micro-batch and their masks,
            the loss gradients of each.
        micro_loss: given ``(outputs_m, mask_m, targets[m])``, the loss gradients for
            micro-batch ``m`` and the terms (loss values) to sum over micro-batches.
        targets: per micro-batch, what ``micro_loss`` reads besides the outputs.
        layer_loss_grads: per micro-batch, d(loss)/d(each loss a layer added in it).
    """

    batch_loss: BatchLossFn | None = None
    micro_loss: MicroLossFn | None = None
    targets: Sequence[Any] | None = None
    layer_loss_grads: Sequence[tf.Tensor] | None = None


def run(
    schedule: Any,
    cells: Sequence[Cell],
    split: Split,
    masks: Sequence[Any],
    rematerializes: Callable[[int], bool],
    sides: Sequence[Any] | None,
    loss: StepLoss,
    deferred: DeferredStats | None,
) -> tuple[list[Any], list[Any], dict[int, Any], list[list[tf.Tensor]], list[list[Any]]]:
    """Build one step of ``schedule``; arguments and results as ``engine.run_schedule``'s.
    With ``loss.micro_loss`` one loop, the loss terms summed over the micro-batches (one
    row); else GPipe's two loops around ``loss.batch_loss``."""
    if loss.micro_loss is None:  # GPipe's loss reads the targets itself
        loss = loss._replace(targets=None)
    halves = bool(getattr(schedule, "split_backward", False))
    # GPipe's loop of forwards: a taped stage keeps what its backward, a loop later, reads;
    # so does a stage whose W a later iteration runs (``loop_waits.weight_lags``).
    stash = loss.micro_loss is None and loss.batch_loss is not None
    later = loop_waits.weight_lags(schedule) if halves and loss.micro_loss is not None else {}
    stages = [
        PipelineStage(c, s == 0, rematerializes(s), halves, False, stash or s in later)
        for s, c in enumerate(cells)
    ]
    with stage.inlined():
        return _Step(
            loop_waits.waits(schedule, later), stages, split, masks, sides, loss, deferred, later=later
        ).run()


def forward(
    cells: Sequence[Cell],
    split: Split,
    masks: Sequence[Any],
    sides: Sequence[Any] | None,
    training: Any,
    taped: bool = False,
    deferred: DeferredStats | None = None,
) -> tuple[list[Any], list[Any], list[list[tf.Tensor]]]:
    """Every micro-batch's forward through every stage as one loop: ``(outputs, their Keras
    masks, the losses layers added)`` per micro-batch. Each stage's forwards in micro-batch
    order. Nothing differentiates it (``evaluate``, ``predict``), or, ``taped``, an
    enclosing tape may (``__call__`` in a custom training step): each stage call is then
    re-materialized (``cell_pass.rematerialized``) and TensorFlow's gradient of the loop is a
    second loop replaying each stage; ``deferred`` pools BatchNormalization moments."""
    waits = [loop_waits.Wait("F", s, "F", s, 1) for s in range(len(cells))]
    stages = [PipelineStage(c, s == 0, True, False, False) for s, c in enumerate(cells)]
    with stage.inlined():
        step = _Step(waits, stages, split, masks, sides, StepLoss(), deferred, training, taped)
        outputs, out_masks, _, cell_losses, _ = step.run()
    return outputs, out_masks, cell_losses


def _dense(grads: list[Any]) -> list[Any]:
    """Weight gradients, rows made dense: a W run in a later iteration adds them to the sums."""
    return [None if g is None else tf.convert_to_tensor(g) for g in grads]


class _Step:
    """One step's loops over ``stages`` (``PipelineStage``s of one schedule), each stage's
    actions in the order ``waits`` keeps."""

    def __init__(
        self, waits, stages, split, masks, sides, loss, deferred, training=True, taped=False, later=None
    ):
        self.stages, self.M, self.deferred, self.taped = stages, len(split), deferred, taped
        self.halves, self.training, self.loss = stages[0].halves, training, loss
        self.cells = cells = [st.cell for st in stages]
        self.tokens = loop_state.Tokens(waits, cells)
        # Micro-batches of one known shape keep it (static shapes trace and run leaner); of
        # several, or unknown, they share a leading dimension of unknown size.
        shapes = {
            tuple(tuple(t.shape.as_list()) for t in tf.nest.flatten(c) if t is not None) for c in split.chunks
        }
        self.relax = len(shapes) != 1 or any(None in shape for shape in next(iter(shapes)))
        M = self.M
        sides = list(sides) if sides is not None else [None] * M
        targets = list(loss.targets) if loss.targets is not None else [None] * M
        flags = [split.nonempty(m) for m in range(M)]
        self.nonempty_all = (
            tf.stack([tf.constant(True) if f is None else f for f in flags]) if split.padded else None
        )
        grads = loss.layer_loss_grads
        self.loss_weights = None if grads is None else tf.stack(list(grads))
        # Each micro-batch's inputs wait on the first stage's device, its targets on the
        # last's, where they are read: an iteration that read a list elsewhere would copy
        # all of it there (a TensorList crosses devices whole), every iteration.
        chunks = [(split.chunks[m], masks[m], sides[m]) for m in range(M)]
        self.inputs = self._stacked(chunks, cells[0].device, self.relax)
        self.targets = self._stacked([(t,) for t in targets], cells[-1].device, self.relax)
        self.input_specs: dict[int, Any] = {}
        self.later: dict[int, int] = later or {}  # stage -> j: its W(m) runs in iteration m + j
        self.layouts: dict = {}  # of what the iterations emit, once the probe has traced one
        # A forward pass alone (``forward``: no loss), which a user's tape may differentiate.
        self.forward_only = loss.micro_loss is None and loss.batch_loss is None

    def _stacked(self, values: list[Any], device: str, relax: bool) -> tuple[loop_state.Layout, list, str]:
        layout = loop_state.Layout(values[0], relax)
        with tf.device(device):
            return layout, layout.filled(values), device

    @staticmethod
    def _read(stacked: tuple[loop_state.Layout, list, str], m: Any) -> Any:
        """Entry ``m`` of what ``_stacked`` filled, read on its device."""
        layout, arrays, device = stacked
        with tf.device(device):
            return layout.expand(layout.read(arrays, m.on(device)))

    def _nonempty(self, m: Any, s: int) -> Any:
        return None if self.nonempty_all is None else self.nonempty_all[m.on(self.cells[s].device)]

    # ---------------------------------------------------------------- one stage's actions
    def forward(self, s, x, mask, side, m, state, now, emit):
        cell = self.cells[s]
        with tf.device(cell.device), tf.name_scope(f"stage{s}_forward"):
            x = ordering.after(self.tokens.before(state, now, "F", s), x)
            local = DeferredStats() if self.deferred is not None else None
            mb = MicroBatch(x, mask, side, self._nonempty(m, s), self.training)
            if self.forward_only:
                y, y_mask, losses = self.stages[s].call(mb, local)
                rec = replay.Record(inputs=x, mask=mask, outputs=y, out_mask=y_mask, losses=losses, side=side)
            else:
                rec = self.stages[s].forward(mb, local)
            now["F", s] = loop_state.token(rec.outputs)
        self.input_specs.setdefault(s, sparse.relaxed_specs((rec.inputs, rec.mask, rec.side)))
        emit["losses", s] = ("each", cell.device, list(rec.losses))
        # Statistics, never differentiated: without the stop, TensorFlow's gradient of a taped
        # loop would differentiate each stage's call for them as well (zeros, at length).
        moments = [] if local is None else [[tf.stop_gradient(t) for t in v] for _, v in local.sums()]
        emit["moments", s] = ("pool", cell.device, moments)
        return rec

    def backward(self, s, rec, dy, m, n_losses, state, now, emit):
        """Stage ``s``'s backward of micro-batch ``m`` (its B and W, when split); returns the
        gradients of its inputs. Its dense weight gradients go into the stage's running sums,
        loop variables, each addition after the previous micro-batch's by dataflow. A padded
        micro-batch's gradients are zeros (its loss and its layers' losses weigh nothing)."""
        cell, st = self.cells[s], self.stages[s]
        loss_grads = self._loss_grads(m.on(cell.device), n_losses)
        halves = self.halves
        rec = dataclasses.replace(rec, nonempty=None)  # nothing to mask (a select per gradient)
        with tf.device(cell.device), tf.name_scope(f"stage{s}_backward"):
            go = self.tokens.before(state, now, "B", s)
            in_grads: list[Any] = []
            if not (halves and s == 0):  # stage 0's input needs no gradient: no B to run
                in_grads, grads = st.backward(rec, dy, loss_grads, go, True, not halves)
            if halves:
                now["B", s] = loop_state.token(in_grads) if s > 0 else loop_state.token(go, dy)
                w_go = self.tokens.before(state, now, "W", s)
                if s in self.later:  # its W runs in a later iteration (``_weights_later``)
                    self._later_weights(s, rec, dy, loss_grads, m.probe is not None, emit, w_go)
                    return in_grads
                _, grads = st.backward(rec, dy, loss_grads, w_go, False, True)
            dense = [None if isinstance(g, tf.IndexedSlices) else g for g in grads]
            emit["grads", s] = ("sum", cell.device, dense)
            now["W" if halves else "B", s] = loop_state.token(in_grads, grads)
            for i, g in enumerate(grads):
                if isinstance(g, tf.IndexedSlices):  # rows: kept apart per micro-batch, not summed
                    emit["rows", s, i] = ("each", cell.device, (g.values, g.indices))
        return in_grads

    def _later_weights(self, s, rec, dy, loss_grads, probe, emit, go):
        """Hold what stage ``s``'s W reads of its B for ``_weights_later``; the probe runs it."""
        st, device = self.stages[s], self.cells[s].device
        emit["held_for_w", s] = ("held", device, (st.stash(rec), list(dy)))
        if probe:
            emit["grads", s] = ("sum", device, _dense(st.backward(rec, dy, loss_grads, go, False, True)[1]))

    def _weights_later(self, m, state):
        """At the end of iteration ``i``, stage ``s``'s W of micro-batch ``i - later[s]``
        where there is one, from what ``_later_weights`` held: its weight gradients, dense,
        added to the stage's running sums in micro-batch order. Then the tokens move on."""
        now = {k[1:]: state[k][0] for k in state if k[0] == "now"}
        for s, j in self.later.items():
            device = self.cells[s].device
            with tf.device(device), tf.name_scope(f"stage{s}_weight_grads"):
                go = self.tokens.before(state, now, "W", s)
                now["W", s] = self._weight_later(s, m.on(device) - j, state, go)
        self.tokens.advance(state, now)

    def _weight_later(self, s, e, state, go):
        """Stage ``s``'s W of micro-batch ``e``, if there is one; its token."""
        st, layout = self.stages[s], self.layouts["held_for_w", s]
        key, sums = ("emitted", ("held_for_w", s)), ("emitted", ("grads", s))
        n_losses = len(self.layouts["losses", s].positions)

        # Added to the running sums here: a branch of zeros where there is no W would be
        # constants the step function holds as long as it lives.
        def run():
            values, released = layout.take(state[key], e, self.M)
            kept, dy = layout.expand(values)
            rec = st.unstash(kept, None, self.deferred is not None)
            grads = st.backward(rec, dy, self._loss_grads(e, n_losses), go, False, True)[1]
            added = [a + b for a, b in zip(state[sums], self.layouts["grads", s].compress(_dense(grads)))]
            return released, added, loop_state.token(added)

        state[key], state[sums], token = tf.cond(
            tf.logical_and(e >= 0, e < self.M), run, lambda: (state[key], state[sums], tf.constant(True))
        )
        return token

    def _loss_grads(self, m, n_losses):
        """What each of the ``n_losses`` losses a stage's layers added in ``m`` receives."""
        return layer_loss_grads(None if self.loss_weights is None else self.loss_weights[m], n_losses)

    def _loss(self, micro_loss, x, mask, target, emit):
        """A micro-batch's loss gradients and terms (``loop_loss.micro_batch_loss``); the
        metric updates it makes leave the iteration, to be made after the loop."""
        device = self.cells[-1].device
        with tf.device(device), tf.name_scope("loss"):
            dy, terms, self.metric_calls, tensors = loop_loss.micro_batch_loss(micro_loss, x, mask, target)
        emit["metric_updates",] = ("each", device, tensors)
        return dy, terms

    def _replay_metric_updates(self, out, state):
        loop_loss.replay_metric_updates(self.metric_calls, out.each(state, ("metric_updates",)))

    # ---------------------------------------------------------------------------- the step
    def run(self):
        micro_loss, batch_loss = self.loss.micro_loss, self.loss.batch_loss
        S, M, cells = len(self.cells), self.M, self.cells
        devices = [c.device for c in cells]

        def read(m):
            return (*self._read(self.inputs, m), *self._read(self.targets, m))

        if micro_loss is not None:

            def iteration(m, state):
                x, mask, side, target = read(m)
                now, emit, records = {}, {}, []
                for s in range(S):
                    records.append(self.forward(s, x, mask, side, m, state, now, emit))
                    x, mask = records[s].outputs, records[s].out_mask
                dy, terms = self._loss(micro_loss, x, mask, target, emit)
                emit["out",] = ("each", cells[-1].device, (x, mask))
                emit["terms",] = ("sum", cells[-1].device, terms)
                for s in reversed(range(S)):
                    dy = self.backward(s, records[s], dy, m, len(records[s].losses), state, now, emit)
                if self.later:  # their tokens move on after the deferred W's (``_weights_later``)
                    state.update({("now", *k): [v] for k, v in now.items()})
                else:
                    self.tokens.advance(state, now)
                return emit

            def seen(out):
                self.layouts = out.layouts

            rest = (max(self.later.values()), self._weights_later) if self.later else None
            out, state = loop_state.emitting(
                M, devices, self.tokens.initial("FBW"), iteration, seen=seen, rest=rest
            )
            self._replay_metric_updates(out, state)
            return self._results([(out, state)], [out.total(state, ("terms",))])

        def forwards(m, state):
            x, mask, side, _ = read(m)
            now, emit = {}, {}
            for s in range(S):
                rec = self.forward(s, x, mask, side, m, state, now, emit)
                if batch_loss is not None:  # what the loop of backwards reads
                    emit["stash", s] = ("held", cells[s].device, self.stages[s].stash(rec))
                x, mask = rec.outputs, rec.out_mask
            emit["out",] = ("each", cells[-1].device, (x, mask))
            self.tokens.advance(state, now)
            return emit

        # TensorFlow's gradient of a taped loop runs as many iterations at once as the loop
        # may, and its replays carry no tokens: each stage could replay every micro-batch at
        # once and hold all their activations. K at a time is what K devices overlap.
        parallel = len(set(devices)) if self.taped else None
        first = loop_state.emitting(M, devices, self.tokens.initial("F"), forwards, not self.taped, parallel)
        if batch_loss is None:  # forwards only
            return self._results([first], [], sums=False)
        # Between GPipe's two loops every stage holds every micro-batch's stash, the step's
        # peak: the outputs are read one entry at a time there, not as a stack (``entries``).
        outputs, out_masks = zip(*first[0].each(first[1], ("out",), stack=False))
        with tf.device(cells[-1].device), tf.name_scope("loss"):
            grads = batch_loss(list(outputs), list(out_masks))
        given = self._stacked(grads, cells[-1].device, self.relax)
        stash = {s: first[0].layouts["stash", s] for s in range(S)}
        n_losses = [len(first[0].layouts["losses", s].positions) for s in range(S)]

        def backwards(m, state):
            now, emit = {}, {}
            dy = self._read(given, m)
            for s in reversed(range(S)):
                with tf.device(cells[s].device):
                    held = state["stash", s]
                    at = m.on(cells[s].device)
                    # Dropped as it is read, as the built-out step drops each record.
                    kept, state["stash", s] = stash[s].take(held, at, M)
                    kept = stash[s].expand(kept)
                rec = self.stages[s].unstash(kept, self._nonempty(m, s), self.deferred is not None)
                dy = self.backward(s, rec, dy, m, n_losses[s], state, now, emit)
            self.tokens.advance(state, now)
            return emit

        carried = self.tokens.initial("BW")
        carried.update({("stash", s): first[1]["emitted", ("stash", s)] for s in range(S)})
        second = loop_state.emitting(M, devices, carried, backwards)
        return self._results([first, second], [], out=(outputs, out_masks))

    def _results(
        self,
        parts: list[tuple[loop_state.Emitted, dict]],
        terms: list[Any],
        sums: bool = True,
        out: Any = None,
    ):
        """The step's results from what its loops emitted; ``out``: the outputs and their masks,
        where the step has read them already."""
        cells, M = self.cells, self.M

        def find(key):
            for emitted, state in parts:
                if key in emitted.layouts:
                    return emitted, state
            return None, None

        if out is None:
            emitted, state = find(("out",))
            out = tuple(zip(*emitted.each(state, ("out",))))
        outputs, out_masks = out
        cell_losses: list[list[tf.Tensor]] = [[] for _ in range(M)]
        totals: dict[int, Any] = {}
        for s, cell in enumerate(cells):
            emitted, state = find(("losses", s))
            if emitted.layouts["losses", s].positions:
                for m, row in enumerate(emitted.each(state, ("losses", s))):
                    cell_losses[m].extend(row)
            if self.deferred is not None:
                emitted, state = find(("moments", s))
                pooled = emitted.total(state, ("moments", s))
                for bn, moments in zip(stage.functions(cell).pooled_layers(True), pooled):
                    self.deferred.add_sums(bn, moments)
            variables = cell.trainable_variables
            if not sums:
                continue
            with tf.device(cell.device):
                found = [i for i in range(len(variables)) if find(("rows", s, i))[0] is not None]
                free = sparse.batch_free(cell, *self.input_specs[s]) if found else frozenset()
                for i in found:  # in micro-batch order, as the built-out step has them
                    emitted, state = find(("rows", s, i))
                    shape = tf.constant(variables[i].shape.as_list(), tf.int32)
                    parts_i = [
                        tf.IndexedSlices(v, ix, shape) for v, ix in emitted.each(state, ("rows", s, i))
                    ]
                    sparse.add_to(totals, variables[i], sparse.combine(parts_i, id(variables[i]) in free))
                emitted, state = find(("grads", s))
                # Out of the loop on the stage's device: what places the optimizer's work on
                # a gradient (a global norm's square) beside it (``tf_gpipe.update``).
                summed = [None if g is None else tf.identity(g) for g in emitted.total(state, ("grads", s))]
                for v, g in zip(variables, summed):
                    sparse.add_to(totals, v, g)
        return list(outputs), list(out_masks), totals, cell_losses, terms
