r"""Train a classifier with GPipe pipeline parallelism (tf_gpipe) on a synthetic task.

The model is a plain list of Keras layers (Dense + BatchNormalization + Dropout
blocks) wrapped in ``tf_gpipe.PipelineModel``: the layers are split into
``--num_stages`` stages, one per device, every mini-batch is cut into
``--num_micro_batches`` micro-batches that flow through the stages in GPipe's
fill-drain order, and with ``--remat=always`` each stage keeps only its input
activations and recomputes the rest in the backward pass (replaying the same
dropout masks, applying BatchNorm updates once).

The data is generated offline: ``--num_classes`` interleaved noisy 2-D spirals
with a fixed numpy seed. On a CPU-only machine the default
``--virtual_cpus=4`` splits the host CPU into 4 logical devices so that the 4
stages are placed on 4 different devices (they share the same cores: this shows
placement, not a speed-up). Use ``--virtual_cpus=0`` to place the stages on the
real devices (GPUs if visible).

Usage (runs as-is, well under 2 minutes on 2 CPU cores):

    python examples/train_classifier.py
    python examples/train_classifier.py --epochs=20 --model_dir=/tmp/gpipe_spirals
    python examples/train_classifier.py --virtual_cpus=0 --num_stages=2 --remat=never

The last line printed is ``SUMMARY {json}`` with the initial and final loss and
accuracy on the held-out test set, for scripts and tests to parse.
"""

from __future__ import annotations

import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # hide TensorFlow's C++ start-up chatter

from absl import app, flags

import tf_gpipe.flags as pipeline_flags

FLAGS = flags.FLAGS

flags.DEFINE_integer(
    "virtual_cpus",
    4,
    "Split the host CPU into this many logical CPU devices before TensorFlow starts, so the "
    "stages can be placed on different devices of a CPU-only machine. 0 = use the real devices.",
)
flags.DEFINE_integer("num_stages", 4, "K: number of pipeline stages (the layers are split evenly).")
flags.DEFINE_integer(
    "num_micro_batches", 8, "M: micro-batches per mini-batch (GPipe's bubble is small once M >= 4K)."
)
flags.DEFINE_enum(
    "remat",
    "always",
    ["always", "except_last", "never"],
    "Re-materialization: keep only each stage's input activations and recompute the rest in the "
    "backward pass ('always'), for every stage but the last ('except_last'), or not at all.",
)
flags.DEFINE_integer("epochs", 20, "Training epochs.")
pipeline_flags.define_plan_flags(FLAGS)
flags.DEFINE_integer("batch_size", 64, "Mini-batch size (split into num_micro_batches micro-batches).")
flags.DEFINE_float("learning_rate", 3e-3, "Adam learning rate.")
flags.DEFINE_integer("num_examples", 3000, "Synthetic examples in total (train + validation + test).")
flags.DEFINE_integer("num_classes", 3, "Number of spiral arms (classes).")
flags.DEFINE_integer("hidden_units", 128, "Width of the hidden Dense layers.")
flags.DEFINE_integer("num_blocks", 3, "Number of Dense+BatchNormalization+Dropout blocks.")
flags.DEFINE_float("dropout", 0.1, "Dropout rate in every block.")
flags.DEFINE_float("validation_split", 0.15, "Share of the training data held out for validation during fit.")
flags.DEFINE_float("test_fraction", 0.2, "Share of all examples held out as the final test set.")
flags.DEFINE_integer("seed", 0, "Seed for the data (numpy) and for Keras' initializers and dropout.")
flags.DEFINE_string(
    "model_dir",
    None,
    "If set, save the pipelined model as model_dir/model.keras and the unsplit export "
    "(model.to_sequential()) as model_dir/sequential.keras.",
)
flags.DEFINE_integer("verbose", 1, "Keras fit verbosity: 0 silent, 1 progress bar, 2 one line per epoch.")


def make_spirals(num_examples: int, num_classes: int, seed: int):
    """Noisy interleaved 2-D spirals, one arm per class; features are float32, labels int32."""
    import numpy as np

    rng = np.random.default_rng(seed)
    labels = rng.integers(0, num_classes, size=num_examples)
    t = np.sqrt(rng.uniform(0.05, 1.0, size=num_examples))  # radius in (0, 1], denser far out
    angle = 3.0 * np.pi * t + 2.0 * np.pi * labels / num_classes + rng.normal(0.0, 0.2, num_examples)
    x = np.stack([t * np.cos(angle), t * np.sin(angle)], axis=1)
    x += rng.normal(0.0, 0.02, size=x.shape)
    return x.astype("float32"), labels.astype("int32")


def build_layers(num_classes: int, hidden_units: int, num_blocks: int, dropout: float):
    """A plain list of Keras layers: the same list would make a keras.Sequential."""
    import keras

    layers = [keras.layers.InputLayer(shape=(2,), name="features")]  # fixes the input shape
    for i in range(num_blocks):
        layers += [
            keras.layers.Dense(hidden_units, activation="relu", name=f"dense_{i}"),
            # Moving statistics move once per mini-batch (as unsplit): with few steps per
            # epoch, momentum 0.9 lets them catch up within the first epochs.
            keras.layers.BatchNormalization(momentum=0.9, name=f"batch_norm_{i}"),
            keras.layers.Dropout(dropout, name=f"dropout_{i}"),
        ]
    layers.append(keras.layers.Dense(num_classes, name="logits"))
    return layers


def main(argv):
    del argv  # unused
    # Logical devices must be configured before TensorFlow runs its first op.
    import tf_gpipe

    if FLAGS.virtual_cpus > 0:
        tf_gpipe.configure_virtual_cpus(FLAGS.virtual_cpus)

    import keras
    import numpy as np

    keras.utils.set_random_seed(FLAGS.seed)

    x, y = make_spirals(FLAGS.num_examples, FLAGS.num_classes, FLAGS.seed)
    n_test = round(FLAGS.test_fraction * len(x))
    x_train, y_train, x_test, y_test = x[n_test:], y[n_test:], x[:n_test], y[:n_test]
    print(
        f"Data: {len(x_train)} training examples (of which {FLAGS.validation_split:.0%} validation), "
        f"{len(x_test)} test examples, {FLAGS.num_classes} classes (spirals)."
    )

    layers = build_layers(FLAGS.num_classes, FLAGS.hidden_units, FLAGS.num_blocks, FLAGS.dropout)
    # With --plan_memory_budget the planner picks K (up to --num_stages), cuts, M, remat, schedule.
    model, _ = pipeline_flags.pipeline_model(
        layers,
        (FLAGS.batch_size, x.shape[1]),
        FLAGS.batch_size,
        name="gpipe_classifier",
        kwargs=dict(
            num_stages=FLAGS.num_stages, num_micro_batches=FLAGS.num_micro_batches, remat=FLAGS.remat
        ),
    )
    model.compile(
        optimizer=keras.optimizers.Adam(FLAGS.learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )

    K, M = model.num_stages, model.num_micro_batches
    print(
        f"PipelineModel: K={K} stages, M={M} micro-batches, remat={model.remat!r}, "
        f"bubble fraction (K-1)/(M+K-1) = {tf_gpipe.bubble_fraction(K, M):.3f}"
    )
    for cell in model.cells:
        names = ", ".join(layer.name for layer in cell.layers)
        print(f"  stage {cell.index} on {cell.device}: {names}")

    initial_loss, initial_acc = model.evaluate(x_test, y_test, batch_size=256, verbose=0)
    print(f"Before training: test loss {initial_loss:.4f}, test accuracy {initial_acc:.4f}")

    start = time.perf_counter()
    history = model.fit(
        x_train,
        y_train,
        batch_size=FLAGS.batch_size,
        epochs=FLAGS.epochs,
        validation_split=FLAGS.validation_split,
        verbose=FLAGS.verbose,
    )
    train_seconds = time.perf_counter() - start

    print("\nLoss curve:")
    print("  epoch    loss  accuracy  val_loss  val_accuracy")
    h = history.history
    for e in range(len(h["loss"])):
        print(
            f"  {e + 1:5d}  {h['loss'][e]:6.4f}  {h['accuracy'][e]:8.4f}  "
            f"{h.get('val_loss', [float('nan')] * (e + 1))[e]:8.4f}  "
            f"{h.get('val_accuracy', [float('nan')] * (e + 1))[e]:12.4f}"
        )

    final_loss, final_acc = model.evaluate(x_test, y_test, batch_size=256, verbose=0)
    print(
        f"\nAfter training ({train_seconds:.1f} s): test loss {final_loss:.4f}, test accuracy {final_acc:.4f}"
    )
    print(f"Stage devices (model.devices): {model.devices}")
    print(f"Layers per stage (model.balance): {model.balance}")

    # Train pipelined, serve unsplit: the export has the same weights, no placement, no micro-batches.
    # The comparison runs in full float32: on a GPU, TF32 matmuls would make two correct
    # computations of different batch shapes differ by ~1e-3.
    sequential = model.to_sequential(name="classifier_unsplit")
    with tf_gpipe.exact_float32():
        pipelined_logits = model.predict(x_test, batch_size=256, verbose=0)
        unsplit_logits = sequential.predict(x_test, batch_size=256, verbose=0)
    max_diff = float(np.max(np.abs(pipelined_logits - unsplit_logits)))
    same_labels = bool(np.array_equal(pipelined_logits.argmax(-1), unsplit_logits.argmax(-1)))
    print(
        f"Unsplit export (model.to_sequential()): max |logit difference| = {max_diff:.2e}, "
        f"same predicted classes: {same_labels}"
    )
    if not (same_labels and max_diff < 1e-4):
        raise SystemExit("The exported unsplit model does not reproduce the pipelined predictions.")

    if FLAGS.model_dir:
        os.makedirs(FLAGS.model_dir, exist_ok=True)
        pipelined_path = os.path.join(FLAGS.model_dir, "model.keras")
        sequential_path = os.path.join(FLAGS.model_dir, "sequential.keras")
        model.save(pipelined_path)
        sequential.save(sequential_path)
        reloaded = keras.saving.load_model(pipelined_path, compile=False)  # only to predict
        reloaded_logits = reloaded.predict(x_test, batch_size=256, verbose=0)
        reload_diff = float(np.max(np.abs(reloaded_logits - pipelined_logits)))
        print(
            f"Saved {pipelined_path} (reloaded: max |logit difference| = {reload_diff:.2e}) "
            f"and {sequential_path}"
        )

    summary = {
        "initial_loss": round(float(initial_loss), 6),
        "final_loss": round(float(final_loss), 6),
        "initial_accuracy": round(float(initial_acc), 6),
        "final_accuracy": round(float(final_acc), 6),
        "train_loss_per_epoch": [round(float(v), 6) for v in h["loss"]],
        "devices": model.devices,
        "balance": model.balance,
        "export_max_abs_diff": max_diff,
        "train_seconds": round(train_seconds, 2),
    }
    print("SUMMARY " + json.dumps(summary))


if __name__ == "__main__":
    app.run(main)
