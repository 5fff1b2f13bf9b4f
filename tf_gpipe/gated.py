"""A taped stage call whose gradient frees each activation as soon as its layer is done.

A stage that is not re-materialized (``remat="never"``, the last stage of
``"except_last"``) runs its forward function under the step's tape (``fit``) or under the
user's (``__call__`` in a custom training step), and its backward is
TensorFlow's gradient of that function call: one backward function, built by TensorFlow
with ``tf.gradients`` ungated. Ungated, the runtime runs the chain of input gradients
ahead of the weight gradients, and every layer's saved activation and incoming gradient
wait for a weight gradient that has not run yet: at K=2, M=2 on a 32-layer MLP the step
held 25 input gradients (8 MiB each) beside the saved activations at its peak
(benchmarks/remat_memory/README.md).

``call`` runs ``Cell.call`` inside a ``tf.custom_gradient`` whose gradient is
``tf.gradients(..., gate_gradients=True)`` over the same forward ops: each op hands on the
gradient of its input only once that of its weights is made too, as the re-materialized
stages' backward (``stage.py``) does. TensorFlow still builds the backward function and
saves the activations it reads; only the order inside it changes. Only while tracing a
function: eagerly (``run_eagerly``) ``cell.call`` runs as it is. The cost: gating takes
some freedom of order from the runtime, about 3% of the steady step of a small
Transformer at K=4, M=16 (benchmarks/compiled_stages/README.md).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tf_gpipe import keras_compat, py_functions, replay, tf_compat
from tf_gpipe.cell import Cell

__all__: list[str] = []


def call(
    cell: Cell, inputs: Any, mask: Any, training: Any, side: dict | None, scope: Any, input_grads: bool
) -> tuple[Any, Any, list[tf.Tensor]]:
    """``cell.call(inputs, mask, training, side)`` with a gated gradient; returns
    ``(outputs, out_mask, losses)``, the losses being those ``scope`` (the forward's
    ``keras_compat.RecordingScope``) collects. ``input_grads``: whether anything
    differentiates the float inputs (not the first stage's data); without, the gradient
    computes none, where gating would otherwise keep them alive unused."""
    if tf.executing_eagerly():
        outputs, out_mask = cell.call(inputs, mask, training, side)
        return outputs, out_mask, list(scope.losses)
    flat_in = tf.nest.flatten(inputs)
    float_pos = replay.float_positions(flat_in) if input_grads else []
    trainable = {id(keras_compat.backing_variable(v)) for v in cell.trainable_variables}
    meta: dict[str, Any] = {}

    @tf.custom_gradient
    def run(*xs):
        graph = tf.compat.v1.get_default_graph()
        swapped = list(flat_in)
        for i, t in zip(float_pos, xs):
            swapped[i] = t
        # Called once per micro-batch, the function's ops run more than once before their
        # gradients: tf.py_function's own gradient holds for one run only (``py_functions``).
        with py_functions.replayed():
            outputs, out_mask = cell.call(tf.nest.pack_sequence_as(inputs, swapped), mask, training, side)
        flat_out = tf.nest.flatten(outputs)
        # None leaves (``{"vec": v, "paddings": None}``) are no outputs of the gradient op.
        kept = [i for i, t in enumerate(flat_out) if t is not None]
        meta.update(outputs=outputs, out_mask=out_mask, n_out=len(flat_out), kept=kept)
        result = [flat_out[i] for i in kept] + list(scope.losses)

        def grad(*dys, variables=None):
            pairs = [(result[i], dys[i]) for i in replay.float_positions(result) if dys[i] is not None]
            # The trainable ones, by the handle the forward function captured: what the
            # forward read. Frozen weights get no gradient, as from Keras' own fit.
            graded = [v for v in variables or [] if id(v) in trainable]
            sources = list(xs) + [graph.capture(v.handle) for v in graded]
            got = [None] * len(sources)
            if pairs and sources:
                # The gradient of a loop (an RNN's while_loop) is a loop whose variables start
                # as the forward loop's stacked per-step values, which reach this function as
                # captured inputs. Inlined, a captured input has no device, and TensorFlow puts
                # a lowered loop's variables where their first values come from: on the
                # default device, while its body runs on the stage's: every time step sent
                # its saved values across devices (benchmarks/recurrent/README.md). An
                # identity on the stage's device keeps the loop there.
                backward = tf.compat.v1.get_default_graph()
                known = len(backward.get_operations())
                with tf.device(cell.device):
                    got = tf.gradients(
                        [t for t, _ in pairs],
                        sources,
                        grad_ys=[g for _, g in pairs],
                        unconnected_gradients=tf.UnconnectedGradients.NONE,
                        gate_gradients=True,
                    )
                    _place_loop_inputs(backward.get_operations()[known:])
            by_id = {id(v): g for v, g in zip(graded, got[len(xs) :])}
            return list(got[: len(xs)]), [by_id.get(id(v)) for v in variables or []]

        return result, grad

    result = run(*[flat_in[i] for i in float_pos])
    flat: list[Any] = [None] * meta["n_out"]
    for i, t in zip(meta["kept"], result):
        flat[i] = t
    outputs = tf.nest.pack_sequence_as(meta["outputs"], flat)
    return outputs, meta["out_mask"], list(result[len(meta["kept"]) :])


def _place_loop_inputs(ops: list[Any]) -> None:
    """Feed the captured (placeholder) inputs of each loop among ``ops`` through an identity
    made on the current device, which its lowered loop variables then take. Resource
    handles stay as they are: a loop reads them where their variables live."""
    for op in ops:
        if op.type not in ("While", "StatelessWhile"):
            continue
        for i, t in enumerate(op.inputs):
            if t.op.type == "Placeholder" and t.dtype != tf.resource:
                with tf.control_dependencies(None):
                    tf_compat.update_input(op, i, tf.identity(t))
