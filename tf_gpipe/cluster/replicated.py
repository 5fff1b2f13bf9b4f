"""ReplicatedPipeline: data x pipeline parallelism, R copies of a pipeline on disjoint devices."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf

from tf_gpipe import keras_compat, trainer

__all__ = ["ReplicatedPipeline"]


class ReplicatedPipeline(keras.Model):
    """Data x pipeline parallelism: R copies of one pipeline on disjoint devices.

    Replica ``r`` is a ``PipelineModel`` of fresh layers from ``make_layers()`` on the
    devices ``device_groups[r]``; all start from replica 0's weights. A training step
    cuts the global batch into R equal shards, each replica computes its shard's loss
    and gradients through its own pipeline as ``PipelineModel.fit`` does (micro-batches,
    ``schedule``, re-materialization, deferred BatchNormalization, mixed-precision loss
    scaling by this model's optimizer), ``tf.distribute.ReductionToOneDevice`` averages
    each variable's R gradients and sends the mean back to every replica's device (an
    all-reduce through TensorFlow's runtime), and one optimizer applies the same update
    to every copy: the replicas stay identical, and the step equals one pipeline's step
    on the whole batch (for losses that average over examples; BatchNormalization
    statistics and dropout masks are per shard). ``predict``/``evaluate`` run replica 0.

    Args:
        make_layers: returns a new list of layers (same architecture) on each call.
        device_groups: one device list per replica, ``K`` devices each, all disjoint.
        input_shape: builds the replicas and copies replica 0's weights to the rest now;
            otherwise call ``build(input_shape)`` before training.
        **pipeline_kwargs: ``num_micro_batches``, ``remat``, ... for every replica.

    Example:

    ```python
    groups = [cluster.worker_devices(4)[0::2], cluster.worker_devices(4)[1::2]]
    model = cluster.ReplicatedPipeline(make_layers, groups, input_shape=(None, 32),
                                       num_micro_batches=4)
    model.compile(optimizer="adam", loss="mse")
    model.fit(x, y, batch_size=128)     # 64 examples per replica
    ```
    """

    def __init__(
        self,
        make_layers: Callable[[], Sequence[keras.layers.Layer]],
        device_groups: Sequence[Sequence[str]],
        input_shape: Sequence[int | None] | None = None,
        **pipeline_kwargs: Any,
    ):
        from tf_gpipe.model import PipelineModel

        super().__init__()
        groups = [list(g) for g in device_groups]
        flat = [d for g in groups for d in g]
        if len(groups) < 1 or len(set(flat)) != len(flat):
            raise ValueError(
                f"tf_gpipe: device_groups must be one or more disjoint device lists, got {groups}; "
                "e.g. [devices[0::2], devices[1::2]] for 2 replicas over 2K devices."
            )
        self.replicas = [PipelineModel(make_layers(), devices=g, **pipeline_kwargs) for g in groups]
        self._cross_device = tf.distribute.ReductionToOneDevice()
        if input_shape is not None:
            self.build(input_shape)

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    def build(self, input_shape: Any) -> None:
        """Build every replica on its devices and give them replica 0's weights."""
        for replica in self.replicas:
            replica.build(input_shape)
        weights = self.replicas[0].get_weights()
        for replica in self.replicas[1:]:
            replica.set_weights(weights)
        self.built = True
        if getattr(self, "optimizer", None) is not None:
            self._build_gradient_sums()

    def _build_gradient_sums(self) -> None:
        # Before the first trace of the step (see PipelineModel._build_training_state).
        for replica in self.replicas:
            replica._build_gradient_sums()

    def call(self, inputs: Any, training: bool | None = None) -> Any:
        return self.replicas[0](inputs, training=training)

    def compile(self, *args: Any, **kwargs: Any) -> None:
        kwargs["jit_compile"] = False  # XLA would ignore the stage placement
        super().compile(*args, **kwargs)
        keras_compat.colocate_optimizer_slots(self.optimizer)  # slots on their replica's devices
        if self.built:
            self._build_gradient_sums()

    def _all_reduce_mean(self, grads: list[list[Any]]) -> list[list[Any]]:
        from tensorflow.python.distribute import values as _values  # PerReplica: no public constructor

        per_var = [_values.PerReplica(tuple(g[i] for g in grads)) for i in range(len(grads[0]))]
        reduced = self._cross_device.batch_reduce(
            tf.distribute.ReduceOp.MEAN, [(v, v) for v in per_var]
        )  # destination = the replicas' own devices: the mean comes back to each of them
        return [[m.values[r] for m in reduced] for r in range(self.num_replicas)]

    def train_step(self, data: Any) -> dict:
        if not self.built:
            raise ValueError(
                "tf_gpipe: build the ReplicatedPipeline first (input_shape=... or "
                "model.build(input_shape)) so that every replica starts from the same weights."
            )
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        R = self.num_replicas
        batch = x.shape[0]
        if batch is not None and batch % R:
            raise ValueError(
                f"tf_gpipe: a batch of {batch} does not split into {R} equal replica shards; "
                f"use a batch_size divisible by {R} (and drop_remainder=True for datasets)."
            )
        shards = [tf.split(t, R) if t is not None else [None] * R for t in (x, y, sample_weight)]
        steps = []
        for r, replica in enumerate(self.replicas):
            # Each replica runs its shard through its own pipeline exactly as PipelineModel.fit
            # would (schedule, loss scaling, deferred BatchNorm), with this model's loss.
            shard = (shards[0][r], shards[1][r], shards[2][r])
            steps.append(trainer.gradients(replica, shard, self.optimizer, loss_model=self))
        # The gradients stay loss-scaled: apply_gradients unscales the mean once.
        mean = self._all_reduce_mean([s.grads for s in steps])
        pairs = [zip(mean[r], replica.trainable_variables) for r, replica in enumerate(self.replicas)]
        self.optimizer.apply_gradients([pair for replica_pairs in pairs for pair in replica_pairs])
        loss = tf.add_n([s.loss for s in steps]) / R
        keras_compat.loss_tracker(self).update_state(
            keras_compat.unscale_loss_for_distribution(loss), sample_weight=tf.shape(x)[0]
        )
        y_pred = tf.nest.map_structure(lambda *t: tf.concat(t, 0), *[s.y_pred for s in steps])
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
