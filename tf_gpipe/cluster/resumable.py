"""ResumableCheckpoint: a restarted training script resumes from its last epoch."""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from tf_gpipe import keras_compat
from tf_gpipe.cluster.connect import client_device

__all__ = ["ResumableCheckpoint"]


class ResumableCheckpoint(keras.callbacks.Callback):
    """Save model and optimizer every epoch; a restarted ``fit`` resumes from the last save.

    A ``tf.train.CheckpointManager`` of ``tf.train.Checkpoint(model, optimizer, every
    model variable, epoch)``, written through this process's CPU (``client_device()``),
    so variables on remote workers land in ``directory`` on this machine. On
    ``fit``, the latest checkpoint, if any, is restored and training goes on with the
    epoch after it (build the model before ``fit``). The same data order
    (``shuffle=False`` or a seeded dataset) then gives the same result as a run that
    was never interrupted.

    Args:
        directory: where the checkpoints go.
        max_to_keep: how many to keep.
    """

    def __init__(self, directory: str, max_to_keep: int = 2):
        super().__init__()
        self.directory, self.max_to_keep = directory, max_to_keep
        self.manager: tf.train.CheckpointManager | None = None
        self.restored_epoch = 0
        self._epoch: tf.Variable | None = None

    def _options(self) -> tf.train.CheckpointOptions:
        return tf.train.CheckpointOptions(experimental_io_device=client_device())

    def on_train_begin(self, logs: Any = None) -> None:
        model = self.model
        if not model.built:
            raise ValueError(
                "tf_gpipe: ResumableCheckpoint restores variables before the first step, so the "
                "model must exist first: call model.build(input_shape) (or the model on a batch) "
                "before fit, as for keras.callbacks.BackupAndRestore."
            )
        if model.optimizer is not None and not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)  # slots exist before restoring
        if self.manager is None:
            with tf.init_scope(), tf.device(client_device()):
                self._epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")
            # model.variables adds what tf.train.Checkpoint(model) misses (e.g. dropout seeds).
            ckpt = tf.train.Checkpoint(
                model=model, optimizer=model.optimizer, variables=list(model.variables), epoch=self._epoch
            )
            self.manager = tf.train.CheckpointManager(ckpt, self.directory, self.max_to_keep)
        assert self._epoch is not None  # made with the manager
        latest = self.manager.latest_checkpoint
        if latest:
            self.manager.checkpoint.restore(latest, options=self._options()).assert_existing_objects_matched()
            self.restored_epoch = int(self._epoch.numpy())
            keras_compat.set_initial_epoch(model, self.restored_epoch)

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        assert self._epoch is not None and self.manager is not None  # made by on_train_begin
        self._epoch.assign(epoch + 1)
        self.manager.save(checkpoint_number=epoch + 1, options=self._options())

    def on_train_end(self, logs: Any = None) -> None:
        # Keras never resets it: a later fit would skip epochs.
        keras_compat.set_initial_epoch(self.model, None)
