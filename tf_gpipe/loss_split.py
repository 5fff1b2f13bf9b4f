"""The loss of a mini-batch as a sum over its micro-batches, for the schedules that start a
backward before the mini-batch is complete (all but GPipe), and the check that the sum is
the mini-batch's loss where arbitrary code could make it another."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tf_gpipe import keras_compat, structure

__all__: list[str] = []


def micro_batch_loss(model: Any, loss_model: Any, y_m, out_m, mask_m, sw_m, n_m, batch_size):
    """The compiled loss of one micro-batch, weighted so the micro-batches sum to
    the mini-batch loss (1F1B must start a backward before the batch is complete).

    Returns ``(value, valid)``. ``valid`` is None, or, for a masked mean, the
    micro-batch's valid mask positions as a fraction of all the mini-batch's mask
    positions. Keras divides a masked loss by the mini-batch's count of valid
    positions, known only once every forward is done; so ``value`` is then the
    micro-batch's masked sum over the mini-batch's positions (a known constant, which
    keeps gradients as small as an unmasked mean's for float16), and train_step
    divides the loss and the summed gradients by the total valid fraction
    (``valid_factor``): linear, so exact.
    """
    compiled = keras_compat.compiled_loss(loss_model)
    if compiled is None:
        raise ValueError(
            f"tf_gpipe: schedule={model.schedule!r} computes the loss per micro-batch and "
            "needs `loss=` in compile() or a compute_loss override that is a mean over examples; "
            "for any other loss use schedule='gpipe'."
        )
    value = compiled(y_m, out_m, sw_m)
    reductions = {
        getattr(getattr(fl, "loss", None), "reduction", "sum_over_batch_size")
        for fl in keras_compat.flat_compiled_losses(loss_model)
    }
    if reductions <= {"sum"}:
        return value, None
    if not (
        reductions <= {"sum_over_batch_size", "mean"}
        or (sw_m is None and reductions <= {"sum_over_batch_size", "mean", "mean_with_sample_weight"})
    ):
        raise ValueError(
            f"tf_gpipe: schedule={model.schedule!r} splits the loss over micro-batches, which "
            f"needs reduction 'sum_over_batch_size' or 'sum' (got {sorted(map(str, reductions))}). "
            "Use schedule='gpipe', which computes the loss on the whole mini-batch."
        )
    masks = [mk for mk in tf.nest.flatten(mask_m) if mk is not None]
    if not masks:
        share = tf.cast(n_m, value.dtype) / tf.cast(batch_size, value.dtype)
        return value * share, None
    if len(tf.nest.flatten(out_m)) > 1:
        raise ValueError(
            f"tf_gpipe: schedule={model.schedule!r} cannot yet split a mean loss over "
            "micro-batches when the model has several outputs and one carries a Keras mask "
            "(each output's loss is divided by its own count of valid positions). "
            "Use schedule='gpipe', which computes the loss on the whole mini-batch."
        )
    mask = tf.cast(masks[0], value.dtype)
    # Keras: value = sum(loss * weight * mask) / valid_m. Mask positions of the whole
    # mini-batch: batch_size * positions per example (the same in every micro-batch).
    per_example = tf.cast(tf.reduce_prod(tf.shape(mask)[1:]), value.dtype)
    positions = tf.cast(batch_size, value.dtype) * per_example
    valid = tf.reduce_sum(mask) / positions
    return value * valid, valid


def valid_factor(model: Any, valid: list[tf.Tensor], cell_losses) -> tf.Tensor:
    """1 / (the mini-batch's fraction of valid mask positions): what turns the summed
    masked losses, and their gradients, into Keras' masked mean."""
    if any(cell_losses):
        # Their gradients share the backward passes with the masked loss's, and must
        # not be divided.
        raise ValueError(
            f"tf_gpipe: schedule={model.schedule!r} cannot combine a masked loss (a Keras mask "
            "on the outputs, e.g. from Embedding(mask_zero=True)) with losses that layers add "
            "(activity regularizers, add_loss): the masked loss is normalized by the "
            "mini-batch's count of valid positions, known only after the backward passes "
            "have begun. Use schedule='gpipe', which computes the loss on the whole mini-batch."
        )
    return tf.math.divide_no_nan(tf.constant(1.0, valid[0].dtype), tf.add_n(valid))


def users_loss(loss_model: Any) -> str | None:
    """The name of a compiled loss written by the user (a ``keras.losses.Loss`` subclass, or
    a function ``compile`` wrapped), or None where every one is Keras' own.

    Keras' losses return one value per example, which the micro-batches' shares weight
    exactly. A user's ``call`` may reduce the batch itself (a maximum, a statistic over
    the batch's pairs) and return one value for it, which no weighting splits: Keras'
    reduction then passes it through, so its reduction says nothing, and the step checks
    such a loss against the whole mini-batch (``checked``).
    """
    for fl in keras_compat.flat_compiled_losses(loss_model):
        loss = getattr(fl, "loss", None)
        code = keras_compat.loss_code(loss)
        if not getattr(code, "__module__", "").startswith("keras."):
            return str(getattr(code, "__name__", None) or getattr(loss, "name", code))
    return None


def checked(
    model: Any, whole: tf.Tensor, parts: list[tf.Tensor], y_pred: Any, what: str, fix: str = ""
) -> Any:
    """An assertion that the micro-batches' weighted losses ``parts`` add up to ``whole``,
    the same loss on the whole mini-batch.

    Weighting each micro-batch's loss by its share n_m/N is exact for a mean over
    examples, which arbitrary code (``what``) cannot be proven to be; a loss that is not
    (a sum, a masked mean, a statistic of the whole batch) gives another value on the
    whole mini-batch, so the step fails before its gradients reach the optimizer, saying
    ``fix`` and that ``"gpipe"`` takes any loss. Non-finite losses pass (Keras trains on
    them too).
    """
    total = tf.add_n(parts) if len(parts) > 1 else parts[0]
    whole, total = tf.cast(whole, tf.float32), tf.cast(total, tf.float32)
    # Rounding only: the same means, in another order. An override may compute in the
    # outputs' dtype (or lower), so 16-bit outputs get room for their coarser rounding.
    floats = {t.dtype for t in tf.nest.flatten(y_pred) + parts if structure.is_float(t)}
    rtol = 6e-2 if tf.bfloat16 in floats else 1e-2 if tf.float16 in floats else 1e-3
    scale = tf.add_n([tf.abs(tf.cast(v, tf.float32)) for v in parts]) + tf.abs(whole)
    ok = tf.logical_or(
        tf.abs(whole - total) <= rtol * scale + 1e-30,
        tf.logical_not(tf.logical_and(tf.math.is_finite(whole), tf.math.is_finite(total))),
    )
    return tf.debugging.Assert(
        ok,
        [
            f"tf_gpipe: schedule={model.schedule!r} computes the loss per micro-batch and weights "
            "each by its share n_m/N of the mini-batch, which is exact only when the loss is a "
            f"mean over examples. {what} is not: on the whole mini-batch it gives",
            whole,
            "but its micro-batches add up to",
            total,
            f"(no update was made). {fix}Use schedule='gpipe', which computes the loss once on the "
            "whole mini-batch.",
        ],
    )
