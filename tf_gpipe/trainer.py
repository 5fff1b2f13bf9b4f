"""One training step of a PipelineModel: schedule, loss, gradients, one optimizer update."""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import keras
import tensorflow as tf

from tf_gpipe import (
    keras_compat,
    loop_choice,
    loss_split,
    microbatch,
    ordering,
    regularization,
    schedules,
    stage,
    structure,
    update,
)
from tf_gpipe.engine import StepLoss, run_schedule
from tf_gpipe.sparse import accumulate

__all__: list[str] = []


def shares(sizes: list[Any], batch_size: tf.Tensor) -> list[tf.Tensor]:
    """Each micro-batch's share n_m / N of the mini-batch.

    Losses that layers add are batch means (Keras divides activity regularization by
    the batch size), so weighting each micro-batch's by its share adds up to the
    unsplit model's value.
    """
    total = tf.cast(batch_size, tf.float32)
    return [tf.math.divide_no_nan(tf.cast(n, tf.float32), total) for n in sizes]


class Gradients(NamedTuple):
    """What one mini-batch's schedule computed, before any optimizer update."""

    grads: list[Any]  # per variable of model.trainable_weights (None: no gradient), loss-scaled
    loss: tf.Tensor  # the mini-batch's loss, as fit reports it (not loss-scaled)
    y_pred: Any  # the last stage's outputs, micro-batches merged
    batch_size: tf.Tensor


def train_step(model: Any, data: Any) -> dict:
    """One mini-batch: the schedule's forwards and backwards stage by stage,
    gradients summed per device, one optimizer update, metrics on the whole batch."""
    step = gradients(model, data)
    return finish_step(model, data, step, model.trainable_weights, model.pipeline.cells[-1].device)


def test_step(model: Any, data: Any, pipeline: Any = None) -> dict:
    """Keras' test step (``evaluate``), with the loss and the metrics beside the outputs, on
    the last stage's device, and each weight's regularization on its device, as in
    ``train_step``. ``pipeline`` (default ``model``): the PipelineModel that ``model``'s call
    runs, whose losses are the ones ``model``'s loss adds (a ReplicatedPipeline's replica 0:
    Keras would add every replica's regularization)."""
    pipeline = model if pipeline is None else pipeline
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    with loop_choice.untaped():  # nothing differentiates the forward: it may be a loop
        y_pred = model(x, training=False)
    batch_size = structure.batch_size(x)  # where the inputs are
    with (
        tf.device(pipeline.pipeline.cells[-1].device),
        regularization.listed(pipeline, None) as reg,
        keras_compat.losses_listed(model, reg.losses),
    ):
        loss = keras_compat.model_compute_loss(model, x, y, y_pred, sample_weight, training=False)
        keras_compat.loss_tracker(model).update_state(
            keras_compat.unscale_loss_for_distribution(loss), sample_weight=batch_size
        )
        return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


def make_state(model: Any) -> None:
    """A built, compiled ``model``'s optimizer slots and its stages' gradient sums, made now,
    not inside the first trace of the training step: a ``tf.function`` that makes variables
    is traced twice, and the step is the long trace."""
    if not model.built or getattr(model, "optimizer", None) is None:
        return
    update.build_optimizer(model.optimizer, model.trainable_variables, model.devices[0])
    build_gradient_sums(model)


def build_gradient_sums(model: Any) -> None:
    """Each stage's variables that sum its gradients over micro-batches, made before the
    training step is traced, where the step will be built out (M > 1, and no loops asked
    for, or a timeline): the loops over micro-batches carry their sums as loop variables,
    which take memory only while the step runs. A step built out that finds none makes
    them in its trace (traced twice, then)."""
    if not (model.built and model.num_micro_batches > 1):
        return
    loops = loop_choice.chosen(getattr(model, "micro_batch_loops", False))
    if getattr(model, "tracer", None) is not None or not loops:
        for cell in model.cells:
            stage.functions(cell).sums.variables(cell.trainable_variables)


def finish_step(
    model: Any, data: Any, step: Gradients, variables: list[Any], outputs_device: str | None = None
) -> dict:
    """The end of ``model``'s training step once ``step`` (its gradients of ``variables``,
    loss-scaled, and loss, outputs and batch size, for the whole ``data``) is computed:
    the loss tracked, one optimizer update, the metrics (computed on ``outputs_device``,
    where the outputs are, if given). A PipelineModel's step, and a ReplicatedPipeline's
    with the replicas' mean gradients, end alike."""
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    keras_compat.loss_tracker(model).update_state(
        keras_compat.unscale_loss_for_distribution(step.loss), sample_weight=step.batch_size
    )
    if variables:
        update.apply(model.optimizer, step.grads, variables)
    else:
        warnings.warn("The model does not have any trainable weights.", stacklevel=3)
    with tf.device(outputs_device):
        return model.compute_metrics(structure.to_tensors(x), y, step.y_pred, sample_weight=sample_weight)


def gradients(model: Any, data: Any, optimizer: Any = None, loss_model: Any = None) -> Gradients:
    """The schedule's forwards and backwards for one mini-batch ``data`` of ``model``
    (a PipelineModel): the loss, each trainable variable's gradient summed per device,
    and the merged outputs. Deferred BatchNormalization statistics are applied.

    ``optimizer`` (default ``model.optimizer``) scales the loss (``scale_loss``, mixed
    precision): the gradients are scaled, as its ``apply_gradients`` expects.
    ``loss_model`` (default ``model``) holds the loss of ``compile(loss=...)``; the
    losses that layers add are ``model``'s own.
    """
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    x = structure.to_tensors(x)
    # Losses an earlier call (evaluate, predict) added belong to another graph; __call__
    # would clear them, but the training step runs the stages without it.
    keras_compat.clear_losses(model)
    if not model.built:
        model.build_cells(structure.spec_from(x))
    opt = model.optimizer if optimizer is None else optimizer
    with regularization.listed(model, opt) as reg:
        return _scheduled(model, x, y, sample_weight, opt, model if loss_model is None else loss_model, reg)


def _scheduled(model, x, y, sample_weight, opt, loss_model, reg: regularization.Regularization) -> Gradients:
    """``gradients``, once ``model`` is built and its weight regularization computed."""
    if loss_model is not model and _overrides_compute_loss(loss_model):
        # The replicas' losses are this model's compiled loss, each on its own shard.
        raise ValueError(
            f"tf_gpipe: {type(loss_model).__name__} overrides compute_loss, which its training "
            "step cannot call: each replica computes the compiled loss of its own shard. Move the "
            "extra term into the compiled loss (a keras.losses.Loss given to compile(loss=...)) "
            "or into a layer's add_loss."
        )
    exact = model.schedule != "gpipe"
    # A compute_loss override runs on each micro-batch, weighted by its share, and is
    # checked against the whole mini-batch's (``loss_split.checked``): exact only for
    # per-example means.
    custom = loss_model is model and _loss_per_micro_batch_override(model)
    main, side = model.separate_inputs(x)
    multiple_of = model.num_stages if model.schedule == "interleaved" else 1
    joint = microbatch.split(
        (main, y, sample_weight, side, x if custom else None), model.num_micro_batches, multiple_of
    )
    xs = joint.select(0)
    plan = schedules.get(model.schedule, model.num_stages, len(xs), model.virtual_stages)
    trainable = model.trainable_weights
    unit = tf.constant(1.0) if opt is None else tf.convert_to_tensor(opt.scale_loss(tf.constant(1.0)))
    batch_size = tf.shape(next(t for t in tf.nest.flatten(x) if t is not None))[0]
    weights = shares(joint.sizes, batch_size)
    state: dict = {"direct": [None] * len(trainable), "loss": [], "valid": []}
    deferred = model.pipeline.deferred_stats(True)

    def batch_loss(outs, masks):
        # Fill-drain: every forward is done, so the loss sees the whole mini-batch,
        # exactly as the unsplit model's does (any loss, any reduction, masks merged).
        flat = [tf.nest.flatten(o) for o in outs]
        watched = [t for f in flat for t in f if structure.is_float(t)]
        with tf.GradientTape() as tape:
            tape.watch(watched)
            y_pred = joint.merge(outs, masks)
            loss = _whole_batch_loss(model, loss_model, x, y, y_pred, sample_weight)
            scaled = loss if opt is None else opt.scale_loss(loss)
        state["loss"].append(loss)
        got = tape.gradient(
            scaled, watched + list(trainable), unconnected_gradients=tf.UnconnectedGradients.NONE
        )
        state["direct"] = got[len(watched) :]
        it = iter(got[: len(watched)])
        return [[next(it) if structure.is_float(t) else None for t in f] for f in flat]

    def micro_loss(out, mask, target):
        y_m, sw_m, x_m, n_m, share_m, nonempty = target
        flat = tf.nest.flatten(out)
        watched = [t for t in flat if structure.is_float(t)]
        with tf.GradientTape() as tape, keras_compat.recorded_metric_updates() as calls:
            tape.watch(watched)
            # ``out`` still carries its Keras mask (set by its last layer): the loss sees it.
            if custom:
                value = keras_compat.model_compute_loss(model, x_m, y_m, out, sw_m, training=True)
                value, valid = value * tf.cast(share_m, value.dtype), None
            else:
                value, valid = loss_split.micro_batch_loss(
                    model, loss_model, y_m, out, mask, sw_m, n_m, batch_size
                )
            if value.shape.rank:  # Keras leaves the loss of a 0-example batch unreduced
                value = tf.reduce_sum(value)
            if nonempty is not None:  # a padded micro-batch's loss is not part of the batch's
                value = tf.where(nonempty, value, tf.zeros_like(value))
                if valid is not None:  # nor are its stand-in example's valid positions
                    valid = tf.where(nonempty, valid, tf.zeros_like(valid))
            scaled = value if opt is None else opt.scale_loss(value)
        # Keras' loss ``Mean`` per output is updated once a step, on the whole mini-batch
        # (below), as Keras' own step does: updated per micro-batch, a step whose last
        # micro-batches differ in size would count them as Keras does not. A metric of the
        # user's is updated here, as each micro-batch's loss calls it.
        per_output = {id(m) for m in keras_compat.compiled_loss_metrics(loss_model) or []}
        for metric, args, kwargs in calls:
            if id(metric) not in per_output:
                metric.update_state(*args, **kwargs)
        # An override may read the weights directly (a penalty of its own): those gradients
        # are terms of the row, summed over the micro-batches as the loss is (by the loops,
        # or below).
        sources = watched + (list(trainable) if custom else [])
        got = tape.gradient(scaled, sources, unconnected_gradients=tf.UnconnectedGradients.NONE)
        it = iter(got[: len(watched)])
        dy = [next(it) if structure.is_float(t) else None for t in flat]
        return dy, [value, valid, *got[len(watched) :]]

    # What each micro-batch's loss reads besides the outputs (``micro_loss``).
    targets = [
        (y_m, sw_m, x_m, tf.convert_to_tensor(n_m), share, joint.nonempty(m))
        for m, ((_, y_m, sw_m, _, x_m), n_m, share) in enumerate(zip(joint.chunks, joint.sizes, weights))
    ]
    outs, out_masks, totals, cell_losses, terms = run_schedule(
        plan,
        model.pipeline.cells,
        xs,
        [None] * len(xs),
        model.pipeline.rematerializes,
        sides=[c[3] for c in joint.chunks],
        loss=StepLoss(
            batch_loss=batch_loss if not exact else None,
            micro_loss=micro_loss if exact else None,
            targets=targets,
            layer_loss_grads=[unit * share for share in weights],
        ),
        tracer=model.tracer,
        deferred=deferred,
        micro_batch_loops=getattr(model, "micro_batch_loops", False),
    )
    state["loss"] += [row[0] for row in terms]
    state["valid"] += [row[1] for row in terms if row[1] is not None]
    if custom:  # an override's gradients w.r.t. the weights, after the loss terms
        for row in terms:
            for i, (v, g) in enumerate(zip(trainable, row[2:])):
                with tf.device(v.value.device):
                    state["direct"][i] = accumulate(state["direct"][i], g)
    loss = tf.add_n(state["loss"]) if len(state["loss"]) > 1 else state["loss"][0]
    factor = loss_split.valid_factor(model, state["valid"], cell_losses) if state["valid"] else None
    if factor is not None:
        loss = loss * tf.cast(factor, loss.dtype)
    if deferred is not None:
        deferred.apply()
    # The outputs merged, and the loss checked on them, beside them: the default device
    # would take every micro-batch's outputs (an LM's logits).
    check, own = None, exact and not custom and loss_split.users_loss(loss_model)
    with tf.device(model.pipeline.cells[-1].device):
        y_pred = joint.merge(outs, out_masks)
        if custom:  # its whole-batch compute_loss updates the loss Mean per output
            whole = keras_compat.model_compute_loss(model, x, y, y_pred, sample_weight, training=True)
            what = f"{type(model).__name__}.compute_loss"
            check = loss_split.checked(model, whole, state["loss"], y_pred, what)
        elif own or (exact and keras_compat.compiled_loss_metrics(loss_model)):
            whole = keras_compat.compiled_loss(loss_model)(y, y_pred, sample_weight)  # and the updates
            if own:
                fix = (
                    "Return one value per example from its call() (Keras averages them), with no "
                    "random draws. "
                )
                check = loss_split.checked(model, whole, [loss], y_pred, f"The loss {own!r}", fix)
    if exact and not custom and reg.losses:  # once per mini-batch, not per micro-batch
        added = tf.add_n([keras_compat.aggregate_additional_loss(model, r) for r in reg.losses])
        loss = loss + tf.cast(added, loss.dtype)
    weighted = [
        tf.cast(c * tf.cast(share, c.dtype), loss.dtype)
        for row, share in zip(cell_losses, weights)
        for c in row
    ]
    if weighted:
        loss = loss + tf.add_n(weighted)
    final = []
    for v, g in zip(trainable, state["direct"]):
        total = totals.get(id(v))
        with tf.device(v.value.device):
            if factor is not None and total is not None:
                total = _scale(total, factor)
            for term in (g, reg.gradient(v, total)):
                if term is not None:
                    total = accumulate(total, term)
        final.append(total)
    if check is not None:  # nothing leaves this step (no update) unless the split loss was exact
        final, loss = ordering.after([check], (final, loss))
    return Gradients(final, loss, y_pred, batch_size)


def _loss_per_micro_batch_override(model: Any) -> bool:
    """Whether ``model``'s step calls its ``compute_loss`` override on each micro-batch (a
    per-micro-batch schedule), whose weight gradients the step sums beside the stages'."""
    return model.schedule != "gpipe" and _overrides_compute_loss(model)


def _overrides_compute_loss(model: Any) -> bool:
    """Whether ``model``'s class overrides ``compute_loss``."""
    return getattr(type(model), "compute_loss", None) is not keras.Model.compute_loss


def _whole_batch_loss(model: Any, loss_model: Any, x, y, y_pred, sample_weight):
    """The loss of the whole mini-batch, as ``keras.Model.train_step`` computes it."""
    if loss_model is model:  # compute_loss, which a model may override
        return keras_compat.model_compute_loss(model, x, y, y_pred, sample_weight, training=True)
    # Another model's compiled loss (a ReplicatedPipeline's), plus this pipeline's own
    # losses: the other's compute_loss would add every replica's.
    compiled = keras_compat.compiled_loss(loss_model)
    terms = [] if compiled is None else [compiled(y, y_pred, sample_weight)]
    terms += [keras_compat.aggregate_additional_loss(loss_model, r) for r in model.losses]
    if not terms:
        raise ValueError("tf_gpipe: no loss to compute; give `loss=` in compile().")
    return tf.add_n(terms) if len(terms) > 1 else terms[0]


def _scale(g, factor):
    factor = tf.cast(factor, g.dtype)
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(g.values * factor, g.indices, g.dense_shape)
    return g * factor


# ------------------------------------------------------------------ saving
