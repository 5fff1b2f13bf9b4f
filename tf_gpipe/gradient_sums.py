"""A stage's gradient sums in a step built out: every micro-batch's weight gradients added to variables.

Built out (``tf_gpipe.engine``: one call per action), fit sums each weight's gradient over
the micro-batches in a variable on the stage's device, added to inside the backward
function as each gradient is made (what PyTorch does with ``.grad``). Summing the
returned gradients in the step instead would add K x M x weights ops to its graph, and,
each backward being one call, would hold a whole stage's gradients at once beside the
running sum. The loops over micro-batches (``tf_gpipe.micro_batch_loop``) carry running
sums as loop variables instead, which exist only while the step runs.

The sums' token (ready once an addition is done) flows as data from the zeroing
through every addition of the stage to the final read: each function call's every
output is read as data. Grappler's function optimizer specializes (rewrites a copy
of) a function for each call with an output nobody reads as data (a token read only
through a control edge, or an IndexedSlices' dense_shape); with every output read it
specializes none. (The first step did not get measurably faster: what grows with M is
elsewhere, benchmarks/compiled_stages/README.md.)
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tf_gpipe import handles, replay, tf_compat
from tf_gpipe.cell import Cell

__all__: list[str] = []


class GradientSums:
    """The gradient-sum variables of one cell, and the functions that zero, add to and read them.

    Args:
        cell: the stage; the variables live in ``cell.gradient_sums``, which outlives a
            remake of its stage functions (a new XLA choice).
        eager: run the bodies directly, not as functions (``run_eagerly``).
    """

    def __init__(self, cell: Cell, eager: bool = False):
        self.cell = cell
        self._sums: dict[int, tf.Variable] = cell.gradient_sums
        # Found while tracing: the variables that get a gradient, and those that get rows.
        self.graded: set = set()
        self.sparse: set = set()
        # Not inlined, as the stage functions (``tf_gpipe.stage``), except the addition: only
        # a taped (not re-materialized) stage adds its gradients with a call of its own,
        # inlined like that stage's forward, so each gradient is added, and freed, as soon as
        # the inlined backward makes it: as one call it would wait for all of them.
        options = dict(reduce_retracing=True, autograph=False, experimental_attributes={"_noinline": True})
        self._add = tf_compat.function(
            self._add_body, jit_compile=False, reduce_retracing=True, autograph=False
        )
        self._zero = tf_compat.function(self._zero_body, jit_compile=False, **options)
        self._read = tf_compat.function(self._read_body, jit_compile=False, **options)
        if eager:  # compile(run_eagerly=True)
            self._add, self._zero, self._read = self._add_body, self._zero_body, self._read_body

    def variables(self, variables: list[Any]) -> list[tf.Variable]:
        """The gradient-sum variables of ``variables`` (made on first use, never saved)."""
        missing = [v for v in variables if id(v) not in self._sums]
        if missing:
            with tf.init_scope(), tf.device(self.cell.device):
                for v in missing:
                    self._sums[id(v)] = tf.Variable(
                        tf.zeros(v.shape, tf.as_dtype(v.dtype)),
                        trainable=False,
                        name=f"grad_sum_{v.name}".replace("/", "_").replace(":", "_"),
                    )
        return [self._sums[id(v)] for v in variables]

    def zero(self) -> tf.Tensor:
        """Set the gradient sums to zero; returns a token that is ready once they are."""
        if not self.variables(self.cell.trainable_variables):
            # Nothing to zero (a frozen stage). Called, a function whose body is one constant
            # is not found by TensorFlow's runtime in Keras' step ("Failed to find definition
            # for function ..._zero_body..._specialized_for_...": NOT_FOUND warnings).
            return tf.constant(True)
        with tf.device(self.cell.device):
            return self._zero()

    def read(self, token: tf.Tensor) -> dict[int, tf.Tensor]:
        """``{id(variable): summed dense gradient}`` for the variables that got one, read
        once ``token`` (the last addition's) is ready."""
        variables = self.cell.trainable_variables
        dense = [
            (v, s)
            for v, s in zip(variables, self.variables(variables))
            if id(v) in self.graded and id(v) not in self.sparse
        ]
        # Called even with no dense sums (a stage whose weights all get rows): it reads the token.
        with tf.device(self.cell.device):
            values = self._read(token, [s for _, s in dense])
        return {id(v): t for (v, _), t in zip(dense, values)}

    def add(
        self, grads: list[tf.Tensor | None], nonempty: Any = None, after: Any = None
    ) -> tuple[tf.Tensor, list[Any]]:
        """Add gradients (following ``cell.trainable_variables``) to the sums, zeroed first
        for an empty micro-batch, once ``after`` (the previous addition's token) is ready;
        returns ``(token, sparse gradients)`` as ``add_in_body``."""
        self.variables(self.cell.trainable_variables)
        with tf.device(self.cell.device):  # inside the loops: the handles as they packed them
            token, rows = handles.call(self._add, list(grads), nonempty, after)
        return token, self.rows_in(rows)

    def _zero_body(self):
        return _ready([s.assign(tf.zeros_like(s)) for s in self.variables(self.cell.trainable_variables)])

    def _read_body(self, token, sums):
        with tf.control_dependencies([token]):
            return [s.read_value() for s in sums]

    def _add_body(self, grads, nonempty, after):
        with tf.control_dependencies([] if after is None else [after]):
            return self.add_in_body(grads, nonempty)

    def add_in_body(self, grads: list[Any], nonempty: Any = None) -> tuple[tf.Tensor, list[Any]]:
        """Add the dense gradients to their sums, none of an empty micro-batch's
        (``nonempty`` False). Returns ``(token, rows)``: the token is ready once every sum
        is added to; ``rows`` holds the IndexedSlices gradients (an Embedding's rows) as
        ``(values, indices)`` pairs (``rows_in`` makes them IndexedSlices again), zeroed for
        an empty micro-batch, which are returned, not summed: Keras' optimizers update a
        weight differently given its gradient as rows than as a dense tensor, and the
        unsplit model gives them rows."""
        dense: list[tuple[Any, Any]] = []
        rows: list[tuple[Any, Any] | None] = []
        variables = self.cell.trainable_variables
        for v, total, g in zip(variables, self.variables(variables), grads):
            if g is not None:
                self.graded.add(id(v))
            if isinstance(g, tf.IndexedSlices):
                self.sparse.add(id(v))
                g = replay.mask_grad(g, nonempty)
                # Without dense_shape, which nobody reads (see the module docstring).
                rows.append((g.values, g.indices))
                continue
            rows.append(None)
            if g is not None:
                dense.append((total, g))

        def add():
            return _ready([total.assign_add(g) for total, g in dense])

        if nonempty is None or not dense:
            return add(), rows
        # Skipped, not masked: a select against zeros is two more passes over every
        # gradient of every micro-batch, where only a padded one (a batch size unknown
        # while tracing, as in fit) can be empty.
        return tf.cond(nonempty, add, lambda: tf.constant(True)), rows

    def rows_in(self, rows: list[Any]) -> list[Any]:
        """``add_in_body``' rows as IndexedSlices of the shape of their variables."""
        return [
            None if r is None else tf.IndexedSlices(r[0], r[1], tf.constant(v.shape.as_list(), tf.int32))
            for v, r in zip(self.cell.trainable_variables, rows)
        ]


def _ready(ops: list[Any]) -> tf.Tensor:
    """A token that is ready once every op of ``ops`` has run."""
    with tf.control_dependencies(ops):
        return tf.constant(True)
