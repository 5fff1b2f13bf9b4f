"""Split a mini-batch into micro-batches along the batch axis, and merge them back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Union

import tensorflow as tf
from keras.src import backend as _kbackend

__all__ = ["Split", "check_batched", "split", "merge"]


@dataclass
class Split:
    """A mini-batch cut into micro-batches.

    Attributes:
        chunks: one nested structure per micro-batch, shaped like the input.
        sizes: the number of examples in each micro-batch (python ints when the
            batch size is known while tracing, else scalar int32 tensors).
        static: True when every size is a python int (no empty micro-batch then).
    """

    chunks: List[Any]
    sizes: List[Union[int, tf.Tensor]]
    static: bool

    def __len__(self) -> int:
        return len(self.chunks)

    def nonempty(self, m: int) -> Optional[tf.Tensor]:
        """A boolean tensor telling whether micro-batch ``m`` holds examples.

        ``None`` when it is known while tracing to hold some.
        """
        size = self.sizes[m]
        if isinstance(size, int):
            return None if size > 0 else tf.constant(False)
        return tf.greater(size, 0)


def _batch_tensors(structure: Any) -> List[tf.Tensor]:
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


def split(structure: Any, num_micro_batches: int, exact: bool = False) -> Split:
    """Cut every tensor of ``structure`` into ``num_micro_batches`` pieces along axis 0.

    The first ``n % M`` micro-batches get one example more than the others, as
    ``numpy.array_split`` does. When the batch size is known while tracing, no
    micro-batch is empty: a batch smaller than ``M`` gives fewer micro-batches.
    When it is only known at run time (a ``None`` batch dimension inside
    ``tf.function``, as in ``model.fit``), there are always ``M`` micro-batches
    and the trailing ones may be empty; ``Split.nonempty`` tells the executor so
    it can discard their side effects and gradients. With ``exact`` there are
    always ``M`` micro-batches (a schedule fixed for M needs them), empty ones included.
    """
    if num_micro_batches < 1:
        raise ValueError(f"tf_gpipe: num_micro_batches must be >= 1, got {num_micro_batches}.")
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
    if known:
        n = known[0]
        m_eff = M if exact else max(1, min(M, n))
        base, rem = divmod(n, m_eff)
        sizes: List[Union[int, tf.Tensor]] = [base + (1 if i < rem else 0) for i in range(m_eff)]
        static = n > 0 and all(sizes)
        if n == 0 and not exact:
            sizes = [0]
        pieces = [tf.split(t, sizes, axis=0) if len(sizes) > 1 else [t] for t in tensors]
    else:
        n = tf.shape(tensors[0], out_type=tf.int32)[0]
        base = n // M
        rem = n % M
        size_vec = base + tf.cast(tf.range(M) < rem, tf.int32)
        sizes = [size_vec[i] for i in range(M)]
        static = False
        pieces = [tf.split(t, size_vec, num=M, axis=0) for t in tensors]
    chunks = []
    for i in range(len(sizes)):
        it = iter(p[i] for p in pieces)
        chunk_flat = [None if t is None else next(it) for t in flat]
        chunks.append(tf.nest.pack_sequence_as(structure, chunk_flat))
    return Split(chunks=chunks, sizes=sizes, static=static)


def _attach_mask(outputs: Any, mask: Any) -> Any:
    """``outputs`` with ``mask`` set as their Keras mask (``mask`` shaped like them, or None).

    Keras losses and metrics read the mask from ``y_pred`` itself: without it they
    count the padding too.
    """
    if mask is None:
        return outputs
    for t, m in zip(tf.nest.flatten(outputs), tf.nest.flatten(mask)):
        if m is not None:
            _kbackend.set_keras_mask(t, m)
    return outputs


def merge(chunks: Sequence[Any], masks: Optional[Sequence[Any]] = None) -> Any:
    """Concatenate per-micro-batch structures back into one mini-batch, in order.

    With ``masks`` (each micro-batch's Keras mask), the merged outputs carry the merged mask.
    """
    if masks is not None and masks[0] is not None:
        return _attach_mask(merge(chunks), merge(masks))
    if len(chunks) == 1:
        return chunks[0]
    flats = [tf.nest.flatten(c) for c in chunks]
    merged = []
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
