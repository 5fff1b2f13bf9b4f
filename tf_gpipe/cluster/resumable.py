"""ResumableCheckpoint: a restarted training script resumes from its last saved step."""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from tf_gpipe import keras_compat
from tf_gpipe.cluster.connect import client_device

__all__ = ["ResumableCheckpoint"]


class ResumableCheckpoint(keras.callbacks.Callback):
    """Save model and optimizer every epoch or every N steps; a restarted ``fit`` resumes there.

    A ``tf.train.CheckpointManager`` of ``tf.train.Checkpoint(model, optimizer, every
    model variable, epoch, batch)``, written through this process's CPU
    (``client_device()``), so variables on remote workers land in ``directory`` on this
    machine. On ``fit``, the latest checkpoint, if any, is restored (weights, optimizer
    slots and step count, dropout seed states) and training goes on where it stopped:
    with the epoch after it, or, for a checkpoint taken inside an epoch, with that
    epoch, whose first ``batch`` batches are read from the data and dropped untrained
    (build the model before ``fit``). The same data order (``shuffle=False`` or a dataset
    that reads the same batches every epoch) then gives the same weights, bit for bit,
    as a run that was never interrupted.

    Args:
        directory: where the checkpoints go.
        max_to_keep: how many to keep.
        save_freq: ``"epoch"``: at the end of every epoch; an integer N: also after
            every N-th training step (counted over the whole run, resumed runs included).
    """

    def __init__(self, directory: str, max_to_keep: int = 2, save_freq: int | str = "epoch"):
        super().__init__()
        if save_freq != "epoch" and (
            isinstance(save_freq, bool) or not isinstance(save_freq, int) or save_freq < 1
        ):
            raise ValueError(
                f"tf_gpipe: ResumableCheckpoint(save_freq={save_freq!r}): pass 'epoch' (save at "
                "the end of every epoch) or a positive number of steps, e.g. save_freq=100."
            )
        self.directory, self.max_to_keep, self.save_freq = directory, max_to_keep, save_freq
        self._every = 0 if save_freq == "epoch" else int(save_freq)  # steps between saves; 0: none
        self.manager: tf.train.CheckpointManager | None = None
        self.restored_epoch = 0
        self.restored_batch = 0  # batches of restored_epoch trained before the checkpoint
        self._epoch: tf.Variable | None = None
        self._batch: tf.Variable | None = None
        self._step: tf.Variable | None = None
        self._steps = 0  # training steps of the whole run, restored ones included
        self._done_in_epoch = 0
        self._epoch_now = 0
        self._train_function: Any = None  # fit's own, while the first batches are skipped

    def _options(self) -> tf.train.CheckpointOptions:
        return tf.train.CheckpointOptions(experimental_io_device=client_device())

    def _make_manager(self, model: keras.Model) -> tf.train.CheckpointManager:
        with tf.init_scope(), tf.device(client_device()):
            self._epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")
            self._batch = tf.Variable(0, dtype=tf.int64, trainable=False, name="batch")
            self._step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
        # model.variables adds what tf.train.Checkpoint(model) misses (e.g. dropout seeds).
        ckpt = tf.train.Checkpoint(
            model=model,
            optimizer=model.optimizer,
            variables=list(model.variables),
            epoch=self._epoch,
            batch=self._batch,
            step=self._step,
        )
        return tf.train.CheckpointManager(ckpt, self.directory, self.max_to_keep)

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
            self.manager = self._make_manager(model)
        assert self._epoch is not None and self._batch is not None and self._step is not None
        latest = self.manager.latest_checkpoint
        if latest:
            self.manager.checkpoint.restore(latest, options=self._options()).assert_existing_objects_matched()
            self.restored_epoch = int(self._epoch.numpy())
            self.restored_batch = int(self._batch.numpy())
            self._steps = int(self._step.numpy())
            keras_compat.set_initial_epoch(model, self.restored_epoch)
            if self.restored_batch:
                self._skip_first_batches(self.restored_batch)
        self._done_in_epoch = self.restored_batch

    def _skip_first_batches(self, count: int) -> None:
        """Make fit's first ``count`` batches be read and dropped, not trained.

        Keras starts a resumed epoch at its first batch. Reading the trained ones from
        the iterator leaves the data where the interrupted run stood, and their
        callbacks see empty logs. fit calls ``model.train_function(iterator)`` once per
        ``steps_per_execution`` batches and looks it up each time, so a stand-in that
        only reads does this, then hands back fit's own function.
        """
        model = self.model
        self._train_function = model.train_function
        per_call = int(getattr(model, "steps_per_execution", 1) or 1)
        left = [count]

        def read_and_drop(iterator: Any) -> dict:
            for _ in range(min(per_call, left[0])):
                iterator.get_next()
            left[0] -= min(per_call, left[0])
            if left[0] <= 0:
                self._stop_skipping()
            return {}

        model.train_function = read_and_drop

    def _stop_skipping(self) -> None:
        if self._train_function is not None:
            self.model.train_function = self._train_function
            self._train_function = None

    def _save(self, epoch: int, batch: int) -> None:
        assert self._epoch is not None and self._batch is not None and self._step is not None
        assert self.manager is not None  # made by on_train_begin
        self._epoch.assign(epoch)
        self._batch.assign(batch)
        self._step.assign(self._steps)
        self.manager.save(options=self._options())

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._epoch_now = epoch

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        done = batch + 1  # batches of this epoch read so far (batch: the call's last index)
        trained = done - self._done_in_epoch
        self._done_in_epoch = done
        if done <= self.restored_batch and self._epoch_now == self.restored_epoch:
            return  # read and dropped: trained before the checkpoint
        before = self._steps
        self._steps += trained
        if not self._every or self._steps // self._every == before // self._every:
            return
        if self.params.get("steps") and done >= self.params["steps"]:
            return  # the epoch's end saves this very state, as the start of the next epoch
        self._save(self._epoch_now, done)

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if self._train_function is not None:
            self._stop_skipping()  # the epoch had no batches left to train
        self._done_in_epoch = 0
        self._save(epoch + 1, 0)

    def on_train_end(self, logs: Any = None) -> None:
        self._stop_skipping()
        # Keras never resets it: a later fit would skip epochs.
        keras_compat.set_initial_epoch(self.model, None)
