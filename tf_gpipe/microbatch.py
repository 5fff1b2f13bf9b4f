"""Split a mini-batch into micro-batches along the batch axis, and merge them back."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import tensorflow as tf

from tf_gpipe import keras_compat

__all__: list[str] = []


class MicroBatch(NamedTuple):
    """One micro-batch as a stage's forward and backward take it.

    Attributes:
        inputs: the stage's inputs (a nested structure of tensors).
        mask: their Keras mask, or None.
        side: the side inputs every stage may read (not differentiated), or None.
        nonempty: a scalar bool tensor, False where the micro-batch holds no real example
            (``Split.padded``); None where every micro-batch does.
        training: Keras' ``training`` argument.
    """

    inputs: Any
    mask: Any = None
    side: dict | None = None
    nonempty: Any = None
    training: Any = None


@dataclass
class Split:
    """A mini-batch cut into micro-batches.

    Attributes:
        chunks: one nested structure per micro-batch, shaped like the input.
        sizes: the number of real examples in each micro-batch (python ints when
            the batch size is known while tracing, else scalar int32 tensors).
        static: True when every size is a python int and none is 0.
        padded: True when a micro-batch may hold no real example: its chunk then
            holds a copy of the batch's last example instead, so that no layer sees
            an empty batch, and everything it produces must be discarded
            (``nonempty`` is False for it; ``merge`` drops its rows).
    """

    chunks: list[Any]
    sizes: list[int | tf.Tensor]
    static: bool
    padded: bool = False

    def __len__(self) -> int:
        return len(self.chunks)

    def nonempty(self, m: int) -> tf.Tensor | None:
        """A boolean tensor telling whether micro-batch ``m`` holds real examples.

        ``None`` when it is known while tracing to hold some.
        """
        size = self.sizes[m]
        if isinstance(size, int):
            return None if size > 0 else tf.constant(False)
        return tf.greater(size, 0)

    def select(self, index: int) -> Split:
        """The same cut of element ``index`` of every chunk (chunks are tuples)."""
        return replace(self, chunks=[c[index] for c in self.chunks])

    def merge(self, outputs: Sequence[Any], masks: Sequence[Any] | None = None) -> Any:
        """Concatenate per-micro-batch ``outputs`` (and their Keras ``masks``) in order,
        keeping only real examples."""
        if self.padded:
            outputs = [self._real(out, n) for out, n in zip(outputs, self.sizes)]
            if masks is not None:
                masks = [self._real(m, n) for m, n in zip(masks, self.sizes)]
        return merge(outputs, masks)

    @staticmethod
    def _real(structure: Any, n: int | tf.Tensor) -> Any:
        return tf.nest.map_structure(lambda t: _head(t, n), structure)


def _head(t: Any, n: int | tf.Tensor) -> Any:
    if t is None or len(t.shape) == 0:  # merge() names the scalar problem
        return t
    return t[:n]


def _batch_tensors(structure: Any) -> list[tf.Tensor]:
    flat = [t for t in tf.nest.flatten(structure) if t is not None]
    if not flat:
        raise ValueError(
            "tf_gpipe: the inputs hold no tensor to split into micro-batches. "
            "Pass a tensor, or a tuple/dict of tensors, whose first axis is the batch."
        )
    out = []
    for t in flat:
        if not (hasattr(t, "shape") and hasattr(t, "dtype")):  # tensors, KerasTensors, arrays
            t = tf.convert_to_tensor(t)
        if len(t.shape) == 0:
            raise ValueError(
                f"tf_gpipe: cannot split a scalar input (shape {t.shape}) into micro-batches: "
                "every input needs a leading batch axis. Add one, e.g. `tf.expand_dims(x, 0)`, "
                "or pass the value as a layer argument instead of an input."
            )
        out.append(t)
    return out


def check_batched(structure: Any) -> None:
    """Raise a ValueError naming the fix unless every tensor has a leading batch axis."""
    _batch_tensors(structure)


def _count(n: int, num_micro_batches: int, multiple_of: int) -> int:
    """How many micro-batches a batch of ``n`` known examples is cut into."""
    if n >= num_micro_batches:
        return num_micro_batches
    # Fewer micro-batches rather than empty ones; a schedule that needs a multiple of
    # K gets the largest that has an example in each, else K (some padded).
    return max(multiple_of, n - n % multiple_of)


def split(structure: Any, num_micro_batches: int, multiple_of: int = 1) -> Split:
    """Cut every tensor of ``structure`` into micro-batches along axis 0.

    The first ``n % M`` micro-batches get one example more than the others, as
    ``numpy.array_split`` does. No layer should see an empty micro-batch that
    the unsplit model would not have seen, so:

    - when the batch size ``n`` is known while tracing and smaller than
      ``M = num_micro_batches``, there are fewer micro-batches (``n``, rounded
      down to a multiple of ``multiple_of``, at least ``multiple_of``);
    - when it is only known at run time (a ``None`` batch dimension inside
      ``tf.function``, as in ``model.fit``), the number of micro-batches must be
      fixed while tracing: there are always ``M``, and one that gets no example
      is given a copy of the batch's last example ("pad and discard").

    A padded micro-batch has size 0 in ``Split.sizes``; ``Split.nonempty`` tells
    the engine to discard its side effects and gradients, and ``Split.merge``
    drops its outputs. An empty mini-batch (``n == 0``) stays empty: every
    micro-batch is empty, as the unsplit model's batch would be.
    """
    if num_micro_batches < 1:
        raise ValueError(f"tf_gpipe: num_micro_batches must be >= 1, got {num_micro_batches}.")
    if num_micro_batches % multiple_of:
        raise ValueError(
            f"tf_gpipe: num_micro_batches ({num_micro_batches}) must be a multiple of {multiple_of}."
        )
    flat = tf.nest.flatten(structure)
    tensors = _batch_tensors(structure)
    tensors = [t if isinstance(t, (tf.Tensor, tf.SparseTensor)) else tf.convert_to_tensor(t) for t in tensors]
    static_n = [t.shape[0] for t in tensors]
    known = [n for n in static_n if n is not None]
    if known and any(n != known[0] for n in known):
        raise ValueError(
            f"tf_gpipe: the inputs disagree on the batch size (first axis sizes {static_n}); "
            "every input tensor must have the same number of examples."
        )
    M = num_micro_batches
    sizes: list[int | tf.Tensor]
    if known:
        n = known[0]
        count = _count(n, M, multiple_of)
        base, rem = divmod(n, count)
        sizes = [base + (1 if i < rem else 0) for i in range(count)]
        static = all(sizes)
        if static:
            pieces = [tf.split(t, sizes, axis=0) if count > 1 else [t] for t in tensors]
        else:  # n < multiple_of, or n == 0
            stand_in = max(n - 1, 0)
            pieces = [
                [t[i : i + 1] if i < n else t[stand_in : stand_in + min(n, 1)] for i in range(count)]
                for t in tensors
            ]
    else:
        n = tf.shape(tensors[0], out_type=tf.int32)[0]
        size_vec = n // M + tf.cast(tf.range(M) < n % M, tf.int32)
        sizes = tf.unstack(size_vec, num=M)
        static = False
        # An empty micro-batch starts at n: it takes the last example instead
        # (none when the whole batch is empty).
        begins = tf.minimum(tf.cumsum(size_vec, exclusive=True), tf.maximum(n - 1, 0))
        lengths = tf.where(n > 0, tf.maximum(size_vec, 1), 0)
        ends = begins + lengths
        if all(isinstance(t, tf.Tensor) for t in tensors):
            pieces = _split_dynamic(tensors, n, size_vec, begins, ends, lengths, M)
        else:  # a SparseTensor: a slice per micro-batch
            pieces = [[t[begins[i] : ends[i]] for i in range(M)] for t in tensors]
    chunks = []
    for i in range(len(sizes)):
        it = iter(p[i] for p in pieces)
        chunk_flat = [None if t is None else next(it) for t in flat]
        chunks.append(tf.nest.pack_sequence_as(structure, chunk_flat))
    return Split(chunks=chunks, sizes=sizes, static=static, padded=not static)


def _split_dynamic(
    tensors: list[tf.Tensor],
    n: tf.Tensor,
    sizes: tf.Tensor,
    begins: tf.Tensor,
    ends: tf.Tensor,
    lengths: tf.Tensor,
    M: int,
) -> list[list[tf.Tensor]]:
    """Each of ``tensors`` (batch size ``n``, known only at run time) cut into its ``M``
    micro-batches: rows ``begins[i]`` to ``ends[i]`` (``lengths[i]`` of them). One split per tensor, not a
    slice per micro-batch: a slice is ~10 ops traced, and a step's ops that grow with M
    are what its first step grows by (benchmarks/first_step/README.md). With ``n >= M`` the
    micro-batches partition the batch; with fewer examples the empty ones repeat the
    last example, gathered first."""

    def exact():
        return [tf.split(t, sizes, num=M) for t in tensors]

    def padded():
        rows = tf.ragged.range(begins, ends).flat_values
        return [tf.split(tf.gather(t, rows), lengths, num=M) for t in tensors]

    return tf.cond(n >= M, exact, padded)


def _attach_mask(outputs: Any, mask: Any) -> Any:
    """``outputs`` with ``mask`` set as their Keras mask (``mask`` shaped like them, or None).

    Keras losses and metrics read the mask from ``y_pred`` itself: without it they
    count the padding too.
    """
    if mask is None:
        return outputs
    for t, m in zip(tf.nest.flatten(outputs), tf.nest.flatten(mask)):
        if m is not None:
            keras_compat.set_keras_mask(t, m)
    return outputs


def merge(chunks: Sequence[Any], masks: Sequence[Any] | None = None) -> Any:
    """Concatenate per-micro-batch structures back into one mini-batch, in order.

    With ``masks`` (each micro-batch's Keras mask), the merged outputs carry the merged mask.
    """
    if masks is not None and masks[0] is not None:
        return _attach_mask(merge(chunks), merge(masks))
    if len(chunks) == 1:
        return chunks[0]
    flats = [tf.nest.flatten(c) for c in chunks]
    merged: list[Any] = []
    for parts in zip(*flats):
        if parts[0] is None:
            merged.append(None)
        elif parts[0].shape.rank == 0:
            raise ValueError(
                "tf_gpipe: a stage returned a scalar; every stage output must keep the "
                "batch axis so micro-batches can be merged back."
            )
        else:
            merged.append(tf.concat(list(parts), axis=0))
    return tf.nest.pack_sequence_as(chunks[0], merged)
