r"""Fit a BatchNorm CNN with GPipe (tf_gpipe), using Keras' own callbacks unchanged.

The model is a plain list of Keras layers, three blocks of Conv2D +
BatchNormalization + ReLU (+ pooling), then global average pooling, Dropout and
a Dense head, wrapped in ``tf_gpipe.PipelineModel``; every pipeline setting
comes from ``tf_gpipe.flags`` (``--num_stages``, ``--num_micro_batches``,
``--schedule``, ``--balance``, ``--remat``, ``--virtual_cpus``, ...). It trains with
``model.fit`` and three stock Keras callbacks:

* ``keras.callbacks.ModelCheckpoint`` saves the pipelined model as
  ``--model_dir/best.keras`` whenever the validation loss improves;
* ``keras.callbacks.EarlyStopping`` stops once the validation loss has not
  improved for ``--patience`` epochs and restores the best weights;
* ``keras.callbacks.TensorBoard`` writes the curves to ``--model_dir/logs``
  (it needs the ``tensorboard`` package; without it the script writes the same
  epoch scalars with ``tf.summary.write`` and says so).

The data ships offline: scikit-learn's bundled 8x8 handwritten digits (1797
images, 10 classes) when scikit-learn is installed, else procedurally drawn
shapes (disk, square, triangle, plus sign; random position, size, brightness
and noise; ``--image_size`` pixels square). ``--dataset`` picks one explicitly.

Usage (well under a minute on 2 CPU cores):

    python examples/fit_image_classifier.py
    python examples/fit_image_classifier.py --dataset=shapes --epochs=30 --patience=5
    python examples/fit_image_classifier.py --num_stages=2 --num_micro_batches=8 --schedule=1f1b

The last line printed is ``SUMMARY {json}`` for scripts and tests.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # hide TensorFlow's C++ start-up chatter

from absl import app, flags

import tf_gpipe.flags as pipeline_flags

FLAGS = flags.FLAGS

pipeline_flags.define_pipeline_flags(defaults={"num_stages": 4, "num_micro_batches": 4, "virtual_cpus": 4})
pipeline_flags.define_plan_flags(FLAGS)
flags.DEFINE_enum(
    "dataset",
    "auto",
    ["auto", "digits", "shapes"],
    "'digits': scikit-learn's 8x8 digits (needs scikit-learn); 'shapes': drawn in the script; "
    "'auto': digits if scikit-learn is installed, else shapes.",
)
flags.DEFINE_integer("num_examples", 3000, "Images to draw for --dataset=shapes.")
flags.DEFINE_integer("image_size", 16, "Side of the --dataset=shapes images, in pixels.")
flags.DEFINE_string(
    "model_dir",
    os.path.join(tempfile.gettempdir(), "tf_gpipe_image_classifier"),
    "Where ModelCheckpoint writes best.keras and TensorBoard its logs (model_dir/logs).",
)
flags.DEFINE_integer("epochs", 15, "Most epochs to train (EarlyStopping may stop sooner).")
flags.DEFINE_integer("patience", 3, "EarlyStopping: epochs without a better validation loss.")
flags.DEFINE_integer("batch_size", 64, "Mini-batch size (split into --num_micro_batches micro-batches).")
flags.DEFINE_float("learning_rate", 3e-3, "Adam learning rate.")
flags.DEFINE_integer("filters", 16, "Filters of the first Conv2D; each block doubles them.")
flags.DEFINE_float("dropout", 0.2, "Dropout before the Dense head.")
flags.DEFINE_float("test_fraction", 0.2, "Share of the images held out as the test set.")
flags.DEFINE_float("validation_split", 0.15, "Share of the training images fit() validates on.")
flags.DEFINE_integer("seed", 0, "Seed for the data and for Keras' initializers and dropout.")
flags.DEFINE_integer("verbose", 1, "Keras fit verbosity: 0 silent, 1 progress bar, 2 one line per epoch.")

SHAPES = ("disk", "square", "triangle", "plus")


def load_digits():
    """scikit-learn's bundled digits as (N, 8, 8, 1) float32 in [0, 1] and int32 labels."""
    from sklearn.datasets import load_digits as sklearn_digits

    digits = sklearn_digits()
    images = (digits.images / 16.0).astype("float32")[..., None]
    return images, digits.target.astype("int32"), [str(d) for d in range(10)]


def draw_shapes(num_examples: int, size: int, seed: int):
    """Noisy grayscale images of one filled shape each: (N, size, size, 1) float32, int32 labels."""
    import numpy as np

    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size].astype("float32") + 0.5
    labels = rng.integers(0, len(SHAPES), num_examples).astype("int32")
    images = np.empty((num_examples, size, size), dtype="float32")
    for i, label in enumerate(labels):
        r = rng.uniform(0.2, 0.35) * size
        cx, cy = rng.uniform(r, size - r, 2)
        dx, dy = np.abs(xx - cx), np.abs(yy - cy)
        if SHAPES[label] == "disk":
            mask = dx**2 + dy**2 <= r**2
        elif SHAPES[label] == "square":
            mask = (dx <= r * 0.85) & (dy <= r * 0.85)
        elif SHAPES[label] == "triangle":  # apex up, base at cy + r
            mask = (yy >= cy - r) & (yy <= cy + r) & (dx <= (yy - (cy - r)) / 2)
        else:  # plus sign
            mask = ((dx <= r / 3) & (dy <= r)) | ((dy <= r / 3) & (dx <= r))
        images[i] = mask * rng.uniform(0.5, 1.0) + rng.normal(0.0, 0.15, (size, size))
    return np.clip(images, 0.0, 1.0)[..., None], labels, list(SHAPES)


def build_layers(input_shape, num_classes: int, filters: int, dropout: float):
    """A plain list of Keras layers: the same list would make a keras.Sequential."""
    import keras

    layers = [keras.layers.InputLayer(shape=input_shape, name="image")]
    for i in range(3):
        layers += [
            keras.layers.Conv2D(filters * 2**i, 3, padding="same", use_bias=False, name=f"conv_{i}"),
            keras.layers.BatchNormalization(momentum=0.9, name=f"batch_norm_{i}"),
            keras.layers.ReLU(name=f"relu_{i}"),
        ]
        if i < 2:
            layers.append(keras.layers.MaxPooling2D(2, name=f"pool_{i}"))
    layers += [
        keras.layers.GlobalAveragePooling2D(name="global_pool"),
        keras.layers.Dropout(dropout, name="dropout"),
        keras.layers.Dense(num_classes, name="logits"),
    ]
    return layers


def tensorboard_callback(log_dir: str):
    """keras.callbacks.TensorBoard, or a stand-in writing the same epoch scalars if the
    ``tensorboard`` package (which Keras' callback writes through) is not installed."""
    import keras
    import tensorflow as tf

    try:
        import tensorboard  # noqa: F401
    except ImportError:
        print(
            "Note: the tensorboard package is not installed; writing the epoch scalars with "
            "tf.summary.write instead of keras.callbacks.TensorBoard."
        )
        from tensorflow.core.framework import summary_pb2

        scalars = summary_pb2.SummaryMetadata(
            plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars")
        )

        class EpochScalars(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.writers = {
                    run: tf.summary.create_file_writer(os.path.join(log_dir, run))
                    for run in ("train", "validation")
                }

            def on_epoch_end(self, epoch, logs=None):
                for key, value in (logs or {}).items():
                    run, name = ("validation", key[4:]) if key.startswith("val_") else ("train", key)
                    with self.writers[run].as_default():
                        tf.summary.write(
                            "epoch_" + name, tf.constant(float(value)), step=epoch, metadata=scalars
                        )
                for writer in self.writers.values():
                    writer.flush()

        return EpochScalars()
    return keras.callbacks.TensorBoard(log_dir=log_dir)


def main(argv):
    del argv  # unused
    # Logical devices must be configured before TensorFlow runs its first op.
    pipeline_flags.setup_devices(FLAGS)

    import keras
    import numpy as np

    keras.utils.set_random_seed(FLAGS.seed)

    dataset = FLAGS.dataset
    if dataset == "auto":
        try:
            import sklearn  # noqa: F401

            dataset = "digits"
        except ImportError:
            dataset = "shapes"
    if dataset == "digits":
        x, y, class_names = load_digits()
        source = "scikit-learn's 8x8 digits"
    else:
        x, y, class_names = draw_shapes(FLAGS.num_examples, FLAGS.image_size, FLAGS.seed)
        source = f"drawn shapes ({FLAGS.image_size}x{FLAGS.image_size}: {', '.join(SHAPES)})"
    order = np.random.default_rng(FLAGS.seed).permutation(len(x))
    x, y = x[order], y[order]
    n_test = round(FLAGS.test_fraction * len(x))
    x_train, y_train, x_test, y_test = x[n_test:], y[n_test:], x[:n_test], y[:n_test]
    print(
        f"Data: {source}; {len(x_train)} training images (of which {FLAGS.validation_split:.0%} "
        f"validation), {len(x_test)} test images, {len(class_names)} classes."
    )

    layers = build_layers(x.shape[1:], len(class_names), FLAGS.filters, FLAGS.dropout)
    # With --plan_memory_budget the planner picks K (up to --num_stages), cuts, M, remat, schedule.
    sample = (FLAGS.batch_size,) + tuple(x.shape[1:])
    model, _ = pipeline_flags.pipeline_model(layers, sample, FLAGS.batch_size, name="gpipe_cnn")
    model.compile(
        optimizer=keras.optimizers.Adam(FLAGS.learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    K, M = model.num_stages, model.num_micro_batches
    print(
        f"PipelineModel: K={K} stages, M={M} micro-batches, schedule={model.schedule!r}, "
        f"remat={model.remat!r}, deferred_batch_norm={model.deferred_batch_norm}"
    )
    for cell in model.cells:
        print(f"  stage {cell.index} on {cell.device}: {', '.join(layer.name for layer in cell.layers)}")

    os.makedirs(FLAGS.model_dir, exist_ok=True)
    best_path = os.path.join(FLAGS.model_dir, "best.keras")
    log_dir = os.path.join(FLAGS.model_dir, "logs")
    callbacks = [
        keras.callbacks.ModelCheckpoint(best_path, monitor="val_loss", save_best_only=True),
        keras.callbacks.EarlyStopping(
            monitor="val_loss", patience=FLAGS.patience, restore_best_weights=True, verbose=1
        ),
        tensorboard_callback(log_dir),
    ]
    start = time.perf_counter()
    history = model.fit(
        x_train,
        y_train,
        batch_size=FLAGS.batch_size,
        epochs=FLAGS.epochs,
        validation_split=FLAGS.validation_split,
        callbacks=callbacks,
        verbose=FLAGS.verbose,
    )
    train_seconds = time.perf_counter() - start
    h = history.history
    early_stopping = callbacks[1]
    print(
        f"\nTrained {len(h['loss'])} epochs in {train_seconds:.1f} s"
        + (" (stopped early)" if early_stopping.stopped_epoch else "")
        + f"; best validation loss at epoch {early_stopping.best_epoch + 1}."
    )
    print("  epoch    loss  accuracy  val_loss  val_accuracy")
    for e in range(len(h["loss"])):
        print(
            f"  {e + 1:5d}  {h['loss'][e]:6.4f}  {h['accuracy'][e]:8.4f}  "
            f"{h['val_loss'][e]:8.4f}  {h['val_accuracy'][e]:12.4f}"
        )

    test_loss, test_acc = model.evaluate(x_test, y_test, batch_size=256, verbose=0)
    print(
        f"Test set, with the best epoch's weights (restored by EarlyStopping): loss {test_loss:.4f}, "
        f"accuracy {test_acc:.4f}"
    )

    # The file ModelCheckpoint wrote at the same epoch loads as a compiled PipelineModel again,
    # stage layout included.
    best = keras.saving.load_model(best_path)
    best_loss, best_acc = best.evaluate(x_test, y_test, batch_size=256, verbose=0)
    print(
        f"Reloaded {best_path} ({type(best).__name__}, balance {best.balance}): "
        f"test loss {best_loss:.4f}, accuracy {best_acc:.4f}"
    )

    summary = {
        "dataset": dataset,
        "epochs_run": len(h["loss"]),
        "best_epoch": early_stopping.best_epoch + 1,
        "train_loss_per_epoch": [round(float(v), 6) for v in h["loss"]],
        "val_accuracy_per_epoch": [round(float(v), 6) for v in h["val_accuracy"]],
        "test_loss": round(float(test_loss), 6),
        "test_accuracy": round(float(test_acc), 6),
        "reloaded_test_loss": round(float(best_loss), 6),
        "reloaded_test_accuracy": round(float(best_acc), 6),
        "checkpoint": best_path,
        "log_dir": log_dir,
        "devices": model.devices,
        "balance": model.balance,
        "train_seconds": round(train_seconds, 2),
    }
    print("SUMMARY " + json.dumps(summary))


if __name__ == "__main__":
    app.run(main)
