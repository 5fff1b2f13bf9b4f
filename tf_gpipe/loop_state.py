"""What a pipeline loop carries from one iteration to the next, and the loop itself.

``tf_gpipe.micro_batch_loop`` builds a step as ``tf.while_loop``s over micro-batches. Their
loop variables are flat lists of tensors, so every structure a stage passes on (its
outputs, masks, side inputs, losses, the state its forward read) travels as a ``Layout``:
flattened without its Nones, with the specs its loop variables need, and unflattened in
the next iteration. What a stage's backward needs of its forward waits in TensorArrays,
one entry per micro-batch, freed once read::

    forward iteration m:   stage s ─► Layout.compress ─► write(arrays, m, ...)
    backward iteration m:  Layout.read(arrays, m) ─► stage s ─► Layout.free(arrays, m)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from tf_gpipe import tf_compat

__all__: list[str] = []


def relaxed_spec(spec: tf.TensorSpec) -> tf.TensorSpec:
    if spec.shape.rank in (None, 0):
        return spec
    return tf.TensorSpec([None, *spec.shape.as_list()[1:]], spec.dtype)


def _spec(t: Any) -> Any:
    return None if t is None else tf.TensorSpec(t.shape, t.dtype)


def _zeros(spec: tf.TensorSpec) -> tf.Tensor:
    """A stand-in of ``spec``'s structure: no rows where the size is unknown."""
    return tf.zeros([0 if d is None else d for d in spec.shape.as_list()], spec.dtype)


class Layout:
    """A nested structure of tensors or specs as a flat list without its Nones, and back."""

    def __init__(self, structure: Any, relax: bool = False):
        self.structure = structure
        flat = tf.nest.flatten(structure)
        self.positions = [i for i, t in enumerate(flat) if t is not None]
        self.size = len(flat)
        specs = [_spec(flat[i]) for i in self.positions]
        self.specs = [relaxed_spec(s) for s in specs] if relax else specs

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

    def relaxed(self) -> Layout:
        """This layout with a leading dimension of unknown size."""
        return Layout(self.structure, relax=True)

    def spec_structure(self) -> Any:
        return self.expand(self.specs)

    def zeros(self, relax: bool = False) -> list[tf.Tensor]:
        return [_zeros(relaxed_spec(s) if relax else s) for s in self.specs]

    def arrays(self, size: int) -> list[tf.TensorArray]:
        # Of any leading size, so that an entry can be freed (``free``) once read.
        return [
            tf.TensorArray(s.dtype, size=size, infer_shape=False, element_shape=relaxed_spec(s).shape)
            for s in self.specs
        ]

    def read(self, arrays: list[tf.TensorArray], m: Any) -> list[tf.Tensor]:
        return [tf.ensure_shape(a.read(m), s.shape) for a, s in zip(arrays, self.specs)]

    def free(self, arrays: list[tf.TensorArray], m: Any) -> list[tf.TensorArray]:
        """``arrays`` with entry ``m`` replaced by rows of none (where it has rows)."""
        return [
            a.write(m, _zeros(relaxed_spec(s))) if s.shape.rank else a for a, s in zip(arrays, self.specs)
        ]


def write(arrays: list[tf.TensorArray], m: Any, values: Sequence[tf.Tensor]) -> list[tf.TensorArray]:
    return [a.write(m, v) for a, v in zip(arrays, values)]


def run(state: dict, iterations: int, iteration: Callable[[tf.Tensor], None], specs: dict) -> None:
    """Run ``iteration(i)`` for ``i`` in ``range(iterations)`` as a ``tf.while_loop`` whose loop
    variables are everything in ``state`` (lists of tensors and TensorArrays), updated
    in place. The entries of ``specs`` (key: a ``Layout``) enter with its shapes, which
    may leave sizes unknown that the stand-ins they start as have."""
    keys = sorted(state, key=repr)
    shaped = tf.compat.v1.placeholder_with_default
    for k, layout in specs.items():
        values = []
        for v, spec in zip(state[k], layout.specs):
            with tf.device(v.device):  # where the value is: its loop variable's ops go with it
                values.append(shaped(v, spec.shape))
        state[k] = values
    lengths = [len(state[k]) for k in keys]

    def unpack(values):
        it = iter(values)
        for k, n in zip(keys, lengths):
            state[k] = [next(it) for _ in range(n)]

    def body(i, *values):
        unpack(values)
        iteration(i)
        return (i + 1, *[v for k in keys for v in state[k]])

    start = (tf.constant(0), *[v for k in keys for v in state[k]])
    with independent_stages():
        # Every iteration may run at once: each stage's actions are chained through its own
        # loop variables, so the iterations overlap as far as the stages' order allows.
        _, *values = tf.while_loop(
            lambda i, *_: i < iterations, body, start, parallel_iterations=max(iterations, 1)
        )
    unpack(values)


def count(state: dict, s: int) -> tf.Tensor:
    """Stage ``s``'s micro-batch index in this iteration. Each stage counts for itself: the
    loop's own counter lives on one device, and every other device would read it."""
    m = state["micro_batch", s][0]
    state["micro_batch", s] = [m + 1]
    return m


def independent_stages() -> contextlib.AbstractContextManager[None]:
    """Build loops whose body has no automatic control dependencies.

    In a ``tf.function`` TensorFlow makes every output of a loop body wait for every
    stateful op of the body (one NoOp on no device, with a control input from each
    stage's call): each iteration would be a barrier of all K stages, and its control
    edges would cross every device twice, which doubles the loop step's host cost at
    K=8, M=32 (benchmarks/compiled_stages/README.md). The stages need no such order:
    each stage's calls are chained through its own data (outputs forward, the
    gradient-sum token backward). ``tests/test_loop.py`` checks that the flag still
    takes effect."""
    return tf_compat.no_automatic_control_dependencies()
