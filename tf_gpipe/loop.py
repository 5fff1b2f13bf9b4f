"""GPipe's training step as loops over clock ticks: a graph, and a first step, flat in M.

``executor.run_schedule`` builds one stage-function call per (stage, micro-batch)
action: O(K x M) call ops. TensorFlow builds each called function's body again for
every call site while it optimizes and partitions the step graph, so the first step
grows with M (benchmarks/compiled_stages/README.md). For the GPipe schedule with every
stage re-materialized, this module builds the same step around O(K^2) call sites,
whatever M:

* forward phase: at tick ``t`` stage ``s`` runs micro-batch ``t - s``. The ticks in
  which every stage is busy (``t = K .. M - 1``) run as one ``tf.while_loop`` whose
  body calls each stage once; the K fill ticks before it and the K - 1 drain ticks
  after it are built out, as the executor builds every tick.
* the loss of the whole mini-batch, once every forward is done (GPipe's).
* backward phase: at tick ``t`` stage ``s`` runs micro-batch ``t - (K - 1 - s)``, in
  the same three parts.

From one tick to the next a stage hands its outputs (backward: its input gradients)
to its neighbour as loop variables. What a stage's backward needs of its forwards
(its inputs, side inputs and mask, the state each forward read, its layers' losses)
waits in TensorArrays on the stage's device, indexed by micro-batch; they hold
micro-batches of different sizes, so an uneven split needs no padding. Each stage's
calls are chained, forward through its previous output and backward through its
gradient-sum token, so each device runs its actions in GPipe's order, as the
executor's control dependencies make it. The results are the executor's: the same
calls, the same gradient summation order, the same BatchNormalization pooling order.

Every stage input is given a leading dimension of unknown size, so each stage
function is traced once for every micro-batch size (the executor traces a second
signature for the smaller micro-batches of an uneven split).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from tf_gpipe import remat, stage
from tf_gpipe.batchnorm import DeferredStats
from tf_gpipe.cell import Cell
from tf_gpipe.microbatch import Split

__all__ = ["MIN_LOOP_TICKS", "applies", "run"]

# Fewer ticks in the loop than this and the step is built out entirely by the executor:
# a loop of one tick saves one call per stage and costs the loop's own machinery.
MIN_LOOP_TICKS = 2
PAR = 10


def applies(
    schedule: Any,
    cells: Sequence[Cell],
    split: Split,
    masks: Sequence[Any],
    rematerializes: Callable[[int], bool],
    sides: Sequence[Any] | None,
    tracer: Any,
) -> bool:
    """Whether ``run`` builds this step (else the executor builds every action)."""
    S, M = len(cells), len(split)
    if schedule.name != "gpipe" or tracer is not None or tf.executing_eagerly():
        return False
    if M - S < MIN_LOOP_TICKS or not all(rematerializes(s) for s in range(S)):
        return False
    if any(getattr(c, "run_eagerly", False) for c in cells):
        return False
    # TensorArrays hold dense tensors only (no SparseTensor or RaggedTensor input).
    leaves = tf.nest.flatten((split.chunks, list(masks), list(sides or [])))
    return all(t is None or isinstance(t, tf.Tensor) for t in leaves)


def _relaxed(t: Any) -> Any:
    """``t`` with a leading dimension of unknown size, so that every micro-batch size
    shares one trace and one loop-variable shape."""
    if not isinstance(t, tf.Tensor) or t.shape.rank in (None, 0) or t.shape[0] is None:
        return t
    return tf.compat.v1.placeholder_with_default(t, [None, *t.shape.as_list()[1:]])


def _after(deps: Sequence[Any], structure: Any) -> Any:
    """``structure`` re-issued so that its consumers wait for ``deps``."""
    deps = [tf.identity(d) for d in deps if d is not None]
    if not deps:
        return structure
    with tf.control_dependencies(deps):
        return tf.nest.map_structure(lambda t: None if t is None else tf.identity(t), structure)


class _Layout:
    """A nested structure's tensors as a flat list without its Nones, and back."""

    def __init__(self, structure: Any, relax: Callable[[Any], Any] = lambda t: t):
        self.structure = structure
        flat = tf.nest.flatten(structure)
        self.positions = [i for i, t in enumerate(flat) if t is not None]
        self.size = len(flat)
        self.specs = [(flat[i].dtype, relax(flat[i]).shape) for i in self.positions]

    def compress(self, structure: Any) -> list[tf.Tensor]:
        flat = tf.nest.flatten(structure)
        if len(flat) != self.size or any(flat[i] is None for i in self.positions):
            raise RuntimeError("tf_gpipe: a stage changed the structure of its values between micro-batches.")
        return [flat[i] for i in self.positions]

    def expand(self, values: Sequence[Any]) -> Any:
        full: list[Any] = [None] * self.size
        for i, v in zip(self.positions, values):
            full[i] = v
        return tf.nest.pack_sequence_as(self.structure, full)

    def arrays(self, size: int) -> list[tf.TensorArray]:
        return [
            tf.TensorArray(dtype, size=size, infer_shape=False, element_shape=shape)
            for dtype, shape in self.specs
        ]


def _write(arrays: list[tf.TensorArray], m: Any, values: Sequence[tf.Tensor]) -> list[tf.TensorArray]:
    return [a.write(m, v) for a, v in zip(arrays, values)]


def _read(arrays: list[tf.TensorArray], m: Any) -> list[tf.Tensor]:
    return [a.read(m) for a in arrays]


class _Ticks:
    """Runs ``tick(t)`` for ``t`` in a range: built out, or as a ``tf.while_loop`` whose
    loop variables are everything in ``state`` (lists of tensors and TensorArrays)."""

    def __init__(self, state: dict, batched: Sequence[str], relax: Callable[[Any], Any]):
        self.state = state
        self.batched = set(batched)  # state whose leading dimension is the micro-batch's
        self.relax = relax

    def unrolled(self, first: int, last: int, tick: Callable[[Any], None]) -> None:
        for t in range(first, last):
            tick(t)

    def looped(self, first: int, last: int, tick: Callable[[Any], None]) -> None:
        import os
        if os.environ.get("NOLOOP") == tf.get_current_name_scope().split("/")[-1] or os.environ.get("NOLOOP") == "all":
            return self.unrolled(first, last, tick)
        keys = sorted(self.state, key=repr)
        for k in keys:  # these loop variables keep a leading dimension of unknown size
            if k[0] in self.batched:
                self.state[k] = [self.relax(v) for v in self.state[k]]
        lengths = [len(self.state[k]) for k in keys]

        def unpack(values):
            it = iter(values)
            for k, n in zip(keys, lengths):
                self.state[k] = [next(it) for _ in range(n)]

        def body(t, *values):
            unpack(values)
            tick(t)
            if sorted(self.state, key=repr) != keys:
                raise RuntimeError("tf_gpipe: the loop body added state; the ticks before it must make all of it.")
            return (t + 1, *[v for k in keys for v in self.state[k]])

        start = (tf.constant(first), *[v for k in keys for v in self.state[k]])
        _, *values = tf.while_loop(lambda t, *_: t < last, body, start, parallel_iterations=PAR)
        unpack(values)


def run(
    schedule: Any,
    cells: Sequence[Cell],
    split: Split,
    masks: Sequence[Any],
    sides: Sequence[Any] | None,
    batch_loss: Callable[[list[Any], list[Any]], list[list[tf.Tensor | None]]],
    cell_loss_grads: Sequence[tf.Tensor] | None,
    deferred: DeferredStats | None,
) -> tuple[list[Any], list[Any], dict[int, Any], list[list[tf.Tensor]]]:
    """Build one GPipe training step; arguments and results as ``executor.run_schedule``'s."""
    S, M = len(cells), len(split)
    fns = [stage.functions(c) for c in cells]
    sides = list(sides) if sides is not None else [None] * M
    nonempty_all = None
    if split.padded:
        flags = [split.nonempty(m) for m in range(M)]
        nonempty_all = tf.stack([tf.constant(True) if f is None else f for f in flags])

    def nonempty(m: Any) -> Any:
        return None if nonempty_all is None else nonempty_all[m]

    # Micro-batches of one known size keep it (static shapes trace and run leaner); of
    # several sizes, or unknown, they share one leading dimension of unknown size.
    uniform = split.static and len(set(split.sizes)) == 1
    relax = (lambda t: t) if uniform else _relaxed
    loss_weights = None if cell_loss_grads is None else tf.stack(list(cell_loss_grads))
    state: dict[Any, list[Any]] = {}  # what changes from tick to tick
    ins: dict[int, _Layout] = {}  # per stage: (inputs, mask, side)
    outs: dict[int, _Layout] = {}  # per stage: (outputs, out_mask, side)
    kept: dict[int, _Layout] = {}  # per stage: the state its forward read
    added: dict[int, _Layout] = {}  # per stage: the losses its layers added
    norms: dict[int, list[Any]] = {}  # per stage: its BatchNormalization layers, in pooling order
    in_grads_of: dict[int, _Layout] = {}  # per stage > 0: its input gradients
    rows: dict[int, list[tuple[int, Any]]] = {}  # per stage: (variable index, dense_shape) with rows

    # Stage 0's inputs, every micro-batch, on its device; later stages stash theirs as they come.
    first_in = (split.chunks[0], masks[0], sides[0])
    ins[0] = _Layout(first_in, relax)
    with tf.device(cells[0].device):
        arrays = ins[0].arrays(M)
        for m in range(M):
            arrays = _write(arrays, m, ins[0].compress((split.chunks[m], masks[m], sides[m])))
    state["in", 0] = arrays

    def forward(s: int, m: Any) -> None:
        cell = cells[s]
        with tf.device(cell.device):
            if s == 0:
                x, mask, side = ins[0].expand(_read(state["in", 0], m))
            else:  # what stage s - 1 produced at the previous tick
                x, mask, side = outs[s - 1].expand(state["out", s - 1])
            if ("out", s) in state:  # after this stage's previous forward
                x = _after(state["out", s][:1], x)
            if s > 0:
                if s not in ins:
                    ins[s] = _Layout((x, mask, side), relax)
                    state["in", s] = ins[s].arrays(M)
                state["in", s] = _write(state["in", s], m, ins[s].compress((x, mask, side)))
            local = None if deferred is None else DeferredStats()
            with tf.name_scope(f"stage{s}_forward"):
                rec = remat.forward(
                    cell, x, mask, True, remat=True, nonempty=nonempty(m), deferred=local, side=side
                )
            out = (rec.outputs, rec.out_mask, side)
            moments = [] if local is None else local.sums()
            if s not in outs:
                outs[s] = _Layout(out, relax)
                kept[s], added[s] = _Layout(list(rec.before)), _Layout(list(rec.losses))
                state["kept", s], state["added", s] = kept[s].arrays(M), added[s].arrays(M)
                norms[s] = [bn for bn, _ in moments]
                state["moments", s] = [t for _, sums in moments for t in sums]
                if s == S - 1:
                    state["last", s] = outs[s].arrays(M)
            else:  # pooled in the executor's order: micro-batch after micro-batch
                new = [t for _, sums in moments for t in sums]
                state["moments", s] = [a + b for a, b in zip(state["moments", s], new)]
            state["out", s] = [relax(t) for t in outs[s].compress(out)]
            state["kept", s] = _write(state["kept", s], m, kept[s].compress(list(rec.before)))
            state["added", s] = _write(state["added", s], m, added[s].compress(list(rec.losses)))
            if s == S - 1:
                state["last", s] = _write(state["last", s], m, state["out", s])

    def forward_tick(t: Any) -> None:
        for s in reversed(range(S)):  # each stage reads its neighbour's output of the previous tick
            if isinstance(t, int) and not 0 <= t - s < M:
                continue
            forward(s, t - s)

    ticks = _Ticks(state, ("out", "grad"), relax)
    with tf.name_scope("gpipe_forward"):
        ticks.unrolled(0, S, forward_tick)
        ticks.looped(S, M, forward_tick)
        ticks.unrolled(M, M + S - 1, forward_tick)

    # Every forward is done: the whole mini-batch's loss, as the executor computes it.
    outputs, out_masks, cell_losses = [], [], []
    with tf.device(cells[-1].device):
        for m in range(M):
            out, out_mask, _ = outs[S - 1].expand(_read(state["last", S - 1], m))
            outputs.append(out)
            out_masks.append(out_mask)
    for m in range(M):
        row: list[tf.Tensor] = []
        for s in range(S):
            if added[s].positions:
                with tf.device(cells[s].device):
                    row.extend(added[s].expand(_read(state["added", s], m)))
        cell_losses.append(row)
    if deferred is not None:
        for s in range(S):
            for i, bn in enumerate(norms[s]):
                deferred.add_sums(bn, state["moments", s][3 * i : 3 * i + 3])
            del state["moments", s]
    if any(added[s].positions for s in range(S)) and loss_weights is None:
        raise ValueError("tf_gpipe: layers added losses; run_schedule needs cell_loss_grads.")
    with tf.device(cells[-1].device), tf.name_scope("loss"):
        grads = batch_loss(outputs, out_masks)
        given = _Layout(list(grads[0]), relax)
        arrays = given.arrays(M)
        for m in range(M):
            arrays = _write(arrays, m, given.compress(list(grads[m])))
    state["given", S - 1] = arrays
    for s in range(S):
        state.pop(("last", s), None)
        state.pop(("added", s))
        with tf.device(cells[s].device):
            state["token", s] = [fns[s].zero_sums()]

    def backward(s: int, m: Any) -> None:
        cell = cells[s]
        with tf.device(cell.device):
            if s == S - 1:
                dy = given.expand(_read(state["given", s], m))
            else:  # what stage s + 1 produced at the previous tick
                dy = in_grads_of[s + 1].expand(state["grad", s + 1])
            if ("out", s) in state:  # the first backward: after the last forward
                dy = _after(state.pop(("out", s))[:1], dy)
            x, mask, side = ins[s].expand(_read(state["in", s], m))
            before = kept[s].expand(_read(state["kept", s], m))
            losses = added[s].positions
            loss_grads = [loss_weights[m]] * len(losses) if losses else []
            record = remat.Record(
                inputs=x,
                mask=mask,
                outputs=None,
                out_mask=None,
                losses=[],
                nonempty=nonempty(m),
                side=side,
                before=before,
                training=True,
                deferred=deferred is not None,
            )
            with tf.name_scope(f"stage{s}_backward"):
                in_grads, (token, grads) = remat.backward(
                    cell,
                    record,
                    list(dy),
                    loss_grads,
                    True,
                    cell.trainable_variables,
                    need_input_grads=s > 0,
                    to_sums=True,
                    after=state["token", s][0],
                )
            state["token", s] = [token]
            if s not in rows:
                rows[s] = [(i, g.dense_shape) for i, g in enumerate(grads) if g is not None]
                for i, _ in rows[s]:
                    state["values", s, i] = _Layout(grads[i].values, relax).arrays(M)
                    state["indices", s, i] = _Layout(grads[i].indices, relax).arrays(M)
            for i, _ in rows[s]:
                state["values", s, i] = _write(state["values", s, i], m, [grads[i].values])
                state["indices", s, i] = _write(state["indices", s, i], m, [grads[i].indices])
            if s > 0:
                if s not in in_grads_of:
                    in_grads_of[s] = _Layout(list(in_grads))
                state["grad", s] = [relax(g) for g in in_grads_of[s].compress(list(in_grads))]

    def backward_tick(t: Any) -> None:
        for s in range(S):  # each stage reads its neighbour's gradients of the previous tick
            m = t - (S - 1 - s)
            if isinstance(t, int) and not 0 <= m < M:
                continue
            backward(s, m)

    with tf.name_scope("gpipe_backward"):
        ticks.unrolled(0, S, backward_tick)
        ticks.looped(S, M, backward_tick)
        ticks.unrolled(M, M + S - 1, backward_tick)

    totals: dict[int, Any] = {}
    for s in range(S):
        variables = cells[s].trainable_variables
        with tf.device(cells[s].device):
            for i, dense_shape in rows[s]:  # concatenated in micro-batch order, as the executor does
                values = state["values", s, i][0].concat()
                indices = state["indices", s, i][0].concat()
                totals[id(variables[i])] = tf.IndexedSlices(values, indices, dense_shape)
        totals.update(fns[s].read_sums(state["token", s][0]))
    return outputs, out_masks, totals, cell_losses
