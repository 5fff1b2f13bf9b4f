"""ReplicatedPipeline: data x pipeline parallelism, R copies of a pipeline on disjoint devices."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tf_gpipe import keras_compat, trainer, update
from tf_gpipe.model import PipelineModel

__all__ = ["ReplicatedPipeline"]


class ReplicatedPipeline(keras.Model):
    """Data x pipeline parallelism: R copies of one pipeline on disjoint devices.

    Replica ``r`` is a ``PipelineModel`` of fresh layers from ``make_layers()`` on the
    devices ``device_groups[r]``; all start from replica 0's weights. A training step
    cuts the global batch into R equal shards, each replica computes its shard's loss
    and gradients through its own pipeline as ``PipelineModel.fit`` does (micro-batches,
    ``schedule``, re-materialization, deferred BatchNormalization, mixed-precision loss
    scaling by this model's optimizer), then the R copies of each stage average their
    gradients with one collective all-reduce (``CollectiveReduceV2``: a ring between
    CPUs, NCCL between GPUs) of the stage's gradients packed into one buffer, run on the
    R devices of that stage, so every device sends and receives about
    ``2 (R-1) / R`` times the stage's parameters and none gathers the others' (an
    Embedding's rows are gathered instead: the unsplit model's rows, for its optimizer). One
    optimizer applies the same update to every copy: the replicas stay bitwise
    identical, and the step equals one pipeline's step on the whole batch (for losses
    that average over examples; BatchNormalization statistics and dropout masks are per
    shard). ``predict``/``evaluate`` run replica 0.

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
        super().__init__()
        groups = [list(g) for g in device_groups]
        flat = [d for g in groups for d in g]
        if len(groups) < 1 or len(set(flat)) != len(flat):
            raise ValueError(
                f"tf_gpipe: device_groups must be one or more disjoint device lists, got {groups}; "
                "e.g. [devices[0::2], devices[1::2]] for 2 replicas over 2K devices."
            )
        self.replicas = [PipelineModel(make_layers(), devices=g, **pipeline_kwargs) for g in groups]
        self._all_reduce: _StageAllReduce | None = None  # once the variables exist
        if input_shape is not None:
            self.build(input_shape)

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    def build(self, input_shape: Any) -> None:
        """Build every replica on its devices and give them replica 0's weights."""
        for replica in self.replicas:
            replica.build(input_shape)
        # Checks first that the replicas are alike, with a message naming the fix.
        self._all_reduce = _StageAllReduce([r.trainable_variables for r in self.replicas])
        weights = self.replicas[0].get_weights()
        for replica in self.replicas[1:]:
            replica.set_weights(weights)
        self.built = True
        if getattr(self, "optimizer", None) is not None:
            self._build_training_state()

    def _build_training_state(self) -> None:
        # Before the first trace of the step, which would otherwise make them and be traced
        # twice (see trainer.make_state): in the order finish_step applies.
        variables = [v for replica in self.replicas for v in replica.trainable_variables]
        update.build_optimizer(self.optimizer, variables, self.replicas[0].devices[0])
        for replica in self.replicas:
            trainer.build_gradient_sums(replica)

    def call(self, inputs: Any, training: bool | None = None) -> Any:
        return self.replicas[0](inputs, training=training)

    def compile(self, *args: Any, **kwargs: Any) -> None:
        kwargs["jit_compile"] = False  # XLA would ignore the stage placement
        super().compile(*args, **kwargs)
        # Slots beside their replica's variables, each update on its variable's device.
        update.place_optimizer(self.optimizer, self.replicas[0].devices[0])
        if self.built:
            self._build_training_state()

    @tf.autograph.experimental.do_not_convert  # as PipelineModel's steps
    def test_step(self, data: Any) -> dict:
        return trainer.test_step(self, data, self.replicas[0])

    @tf.autograph.experimental.do_not_convert
    def train_step(self, data: Any) -> dict:
        if not self.built or self._all_reduce is None:
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
        mean = self._all_reduce.mean([s.grads for s in steps])
        whole = trainer.Gradients(
            grads=[g for grads in mean for g in grads],
            loss=tf.add_n([s.loss for s in steps]) / R,
            y_pred=tf.nest.map_structure(lambda *t: tf.concat(t, 0), *[s.y_pred for s in steps]),
            batch_size=tf.shape(x)[0],
        )
        # One apply for every replica: one step count, and each replica's update on its devices.
        variables = [v for replica in self.replicas for v in replica.trainable_variables]
        return trainer.finish_step(self, data, whole, variables)


# Collective keys name a group of devices (group_key) and one all-reduce in it
# (instance_key) for the whole life of every process that takes part; a worker's server
# keeps the groups it has seen even after its client is gone. Starting from a random
# base keeps a restarted client (resuming from a checkpoint against the same workers)
# and tf.distribute's own keys (counted from 1) off the keys already in use.
_KEYS = iter(range(random.SystemRandom().randrange(1 << 20, 1 << 29), 1 << 31))


class _StageAllReduce:
    """The mean over replicas of each stage's gradients, computed on the stage's devices.

    Variable ``i`` of every replica is the same weight; the replicas' devices holding it
    form one collective group (one per stage in practice). Per group and dtype, each
    device packs its gradients into one flat buffer, runs one ``CollectiveReduceV2``
    (``Add``, then ``Div`` by R) and unpacks the mean, all on that device.
    """

    def __init__(self, variables: Sequence[Sequence[Any]]):
        self.num_replicas = len(variables)
        devices = [[_device_of(v) for v in replica] for replica in variables]
        count = {len(d) for d in devices}
        if len(count) != 1:
            raise ValueError(
                "tf_gpipe: the replicas have different numbers of trainable variables "
                f"({[len(d) for d in devices]}); make_layers() must build the same layers each call."
            )
        self.shapes = [tuple(v.shape) for v in variables[0]]
        self.dtypes = [v.dtype for v in variables[0]]
        for r, replica in enumerate(variables[1:], 1):
            if [tuple(v.shape) for v in replica] != self.shapes:
                raise ValueError(
                    f"tf_gpipe: replica {r}'s weights differ in shape from replica 0's; "
                    "make_layers() must build the same layers each call."
                )
        # One group per tuple of devices (stage k of every replica), in first-use order.
        self.groups: dict[tuple[str, ...], list[int]] = {}
        for i in range(len(self.shapes)):
            self.groups.setdefault(tuple(d[i] for d in devices), []).append(i)
        self.group_keys = {group: next(_KEYS) for group in self.groups}
        self.instance_keys = {
            (group, dtype): next(_KEYS)
            for group, indices in self.groups.items()
            for dtype in dict.fromkeys(self.dtypes[i] for i in indices)
        }
        # Inside a tf.function, automatic control dependencies chain stateful ops that
        # share no resource in program order: replica 0's collective would have to finish
        # before replica 1's starts, and neither finishes alone. A resource per device
        # (tf.distribute's "ordering token") orders only the collectives of that device.
        self.tokens: dict[str, Any] = {}
        self.row_keys: dict[tuple[tuple[str, ...], int], list[int]] = {}
        with tf.init_scope():
            for device in dict.fromkeys(d for group in self.groups for d in group):
                with tf.device(device):
                    self.tokens[device] = tf.Variable(0.0, trainable=False, name="all_reduce_order")

    def mean(self, grads: Sequence[Sequence[Any]]) -> list[list[Any]]:
        """``grads[r][i]``: replica r's gradient of variable i -> the same list of means."""
        R = self.num_replicas
        if R == 1:
            return [list(g) for g in grads]
        out: list[list[Any]] = [[None] * len(self.shapes) for _ in range(R)]
        for group, indices in self.groups.items():
            for dtype in dict.fromkeys(self.dtypes[i] for i in indices):
                # Every replica leaves the same variables without gradient (same layers).
                pack = [i for i in indices if self.dtypes[i] == dtype and grads[0][i] is not None]
                # An embedding's rows stay rows: every replica gets all replicas' rows, in
                # replica order (the unsplit model's rows of the whole batch), each divided
                # by R. Summed into one dense buffer, Adam and the like would see other
                # values (they square each row before adding up the rows of one index).
                rows = [i for i in pack if isinstance(grads[0][i], tf.IndexedSlices)]
                for i in rows:
                    for r, device in enumerate(group):
                        with tf.device(device):
                            out[r][i] = self._rows(grads[r][i], group, i, device)
                pack = [i for i in pack if i not in rows]
                if not pack:
                    continue
                sizes = [int(np.prod(self.shapes[i])) for i in pack]
                for r, device in enumerate(group):
                    with tf.device(device):
                        flat = tf.concat([tf.reshape(grads[r][i], [-1]) for i in pack], 0)
                        total = tf.raw_ops.CollectiveReduceV2(
                            input=flat,
                            group_size=R,
                            group_key=self.group_keys[group],
                            instance_key=self.instance_keys[(group, dtype)],
                            ordering_token=[self.tokens[device].handle],
                            merge_op="Add",
                            final_op="Div",
                            communication_hint="auto",  # NCCL between GPUs, a ring otherwise
                        )
                        for i, piece in zip(pack, tf.split(total, sizes)):
                            out[r][i] = tf.reshape(piece, self.shapes[i])
        return out

    def _rows(self, grad: tf.IndexedSlices, group: tuple[str, ...], i: int, device: str) -> tf.IndexedSlices:
        """All replicas' rows of variable ``i``'s gradient, on ``device``: three
        ``CollectiveGatherV2`` (the row counts, then values and indices padded to the
        largest count, the padding dropped after), each with an instance key of its own,
        made at the first trace and kept, as the packed buffers' are."""
        R = self.num_replicas
        keys = self.row_keys.setdefault((group, i), [next(_KEYS) for _ in range(3)])

        def gather(t: tf.Tensor, key: int) -> tf.Tensor:
            return tf.raw_ops.CollectiveGatherV2(
                input=t,
                group_size=R,
                group_key=self.group_keys[group],
                instance_key=key,
                ordering_token=[self.tokens[device].handle],
                communication_hint="auto",
            )

        count = tf.shape(grad.indices, out_type=tf.int32)[:1]
        counts = gather(count, keys[0])
        most = tf.reduce_max(counts)
        padding = [[0, most - count[0]]]
        values = tf.pad(grad.values, padding + [[0, 0]] * (grad.values.shape.rank - 1))
        values = gather(values, keys[1])
        rows = gather(tf.pad(grad.indices, padding), keys[2])
        kept = tf.reshape(tf.sequence_mask(counts, most), [-1])
        divided = tf.boolean_mask(values, kept) / tf.cast(R, values.dtype)
        return tf.IndexedSlices(divided, tf.boolean_mask(rows, kept), grad.dense_shape)


def _device_of(variable: Any) -> str:
    return tf.DeviceSpec.from_string(keras_compat.variable_device(variable) or "").to_string()
