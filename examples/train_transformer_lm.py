r"""Train a small Transformer language model with GPipe (tf_gpipe), resumable, on Python's own source.

The model is a plain list of Keras layers: a token + position embedding, N
decoder blocks (causal self-attention and an MLP, each with LayerNormalization
and a residual connection), a final LayerNormalization and a Dense layer to the
vocabulary. ``tf_gpipe.PipelineModel`` cuts the list into ``--num_stages``
stages and runs every mini-batch as ``--num_micro_batches`` micro-batches; all
pipeline settings come from ``tf_gpipe.flags`` (``--schedule``, ``--balance``,
``--remat``, ``--devices``, ...).

The corpus is real text that every machine has offline: a fixed, sorted list
of modules of the Python standard library that runs this script (their code and
docstrings), cut to ``--corpus_kb`` kilobytes and tokenized by character
(printable ASCII and newline, 96 tokens). The last 5% is held out.

Training is ``model.fit`` with Keras' progress bar. One Keras "epoch" is
``--checkpoint_every`` steps: after each, a ``tf.train.CheckpointManager`` saves
the model (weights, and the dropout layers' seed states), the optimizer and the
step to ``--model_dir``. The batch of step s is a function of (``--seed``, s)
alone, so a run that is killed and started again with the same flags resumes
from the last checkpoint and follows exactly the loss curve of a run that was
never interrupted (``--stop_after_steps`` simulates the kill). TensorBoard logs
go to ``--model_dir/logs``: loss, examples/s and tokens/s per epoch, and the
pipeline settings as text. At the end the script exports the unsplit model
(``model.to_sequential()``) to ``--model_dir/lm.keras``, loads it back, checks
it against the pipelined model and generates a text sample with it.

Usage (the defaults train for about 1-2 minutes on 2 CPU cores):

    python examples/train_transformer_lm.py
    python examples/train_transformer_lm.py --model_dir=/tmp/lm --schedule=1f1b
    python examples/train_transformer_lm.py --num_stages=2 --balance=3,4 --num_micro_batches=8
    python examples/train_transformer_lm.py --plan_memory_budget=256MiB  # tf_gpipe.plan chooses

Running it again with the same ``--model_dir`` resumes (or, when training is
complete, only exports and samples); use a new ``--model_dir`` to start over.
The last line printed is ``SUMMARY {json}`` for scripts and tests.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # hide TensorFlow's C++ start-up chatter

from absl import app, flags, logging

import tf_gpipe.flags as pipeline_flags

FLAGS = flags.FLAGS

pipeline_flags.define_pipeline_flags(defaults={"num_stages": 4, "num_micro_batches": 4, "virtual_cpus": 4})
pipeline_flags.define_plan_flags(FLAGS)
flags.DEFINE_string(
    "model_dir",
    os.path.join(tempfile.gettempdir(), "tf_gpipe_lm"),
    "Checkpoints, TensorBoard logs (model_dir/logs) and the exported lm.keras. A run with the "
    "same model_dir resumes from its last checkpoint.",
)
flags.DEFINE_integer("steps", 480, "Training steps (mini-batches) in all; a multiple of --checkpoint_every.")
flags.DEFINE_integer(
    "checkpoint_every",
    60,
    "Save a checkpoint every this many steps; it is also the length of a Keras epoch (one line "
    "of the progress bar, one point of the TensorBoard curves).",
)
flags.DEFINE_integer("max_to_keep", 3, "Checkpoints kept in model_dir.")
flags.DEFINE_integer("batch_size", 32, "Sequences per mini-batch (split into --num_micro_batches).")
flags.DEFINE_integer("seq_len", 64, "Tokens (characters) per training sequence.")
flags.DEFINE_integer("num_layers", 4, "Transformer blocks.")
flags.DEFINE_integer("d_model", 64, "Width of the embeddings and of the residual stream.")
flags.DEFINE_integer("num_heads", 4, "Attention heads per block (d_model must be divisible by it).")
flags.DEFINE_integer("mlp_dim", 256, "Hidden width of each block's MLP.")
flags.DEFINE_float("dropout", 0.1, "Dropout on attention weights and on each residual branch.")
flags.DEFINE_float("learning_rate", 5e-3, "Peak Adam learning rate (linear warm-up, then cosine decay).")
flags.DEFINE_integer("warmup_steps", 20, "Steps of linear learning-rate warm-up.")
flags.DEFINE_integer("corpus_kb", 300, "Kilobytes of standard-library source to read (train + held out).")
flags.DEFINE_integer("seed", 0, "Seed for the weights, the dropout masks and the batches.")
flags.DEFINE_integer("sample_length", 300, "Characters to generate with the exported model.")
flags.DEFINE_float("temperature", 0.7, "Sampling temperature; 0 = greedy (always the likeliest character).")
flags.DEFINE_string("prompt", "def ", "Text the generated sample starts from.")
flags.DEFINE_integer(
    "stop_after_steps",
    0,
    "Testing aid: end the process abruptly (no checkpoint, no export) once this many steps of "
    "the whole run are done, as if it had been killed. 0 = off.",
)
flags.DEFINE_boolean(
    "print_step_losses", False, "Print 'STEP_LOSS <step> <loss>' after every step, for scripts."
)
flags.DEFINE_integer("verbose", 1, "Keras fit verbosity: 0 silent, 1 progress bar, 2 one line per epoch.")

flags.register_validator("steps", lambda v: v >= 1, "--steps must be >= 1")
flags.register_validator("checkpoint_every", lambda v: v >= 1, "--checkpoint_every must be >= 1")
flags.register_multi_flags_validator(
    ["steps", "checkpoint_every"],
    lambda f: f["steps"] % f["checkpoint_every"] == 0,
    "--steps must be a multiple of --checkpoint_every (one Keras epoch is --checkpoint_every steps)",
)
flags.register_multi_flags_validator(
    ["d_model", "num_heads"],
    lambda f: f["num_heads"] >= 1 and f["d_model"] % f["num_heads"] == 0,
    "--d_model must be divisible by --num_heads",
)

# Standard-library modules present in every CPython 3.8 to 3.13, read in this order.
CORPUS_MODULES = (
    "argparse.py",
    "bisect.py",
    "calendar.py",
    "contextlib.py",
    "copy.py",
    "dataclasses.py",
    "fnmatch.py",
    "fractions.py",
    "functools.py",
    "heapq.py",
    "pprint.py",
    "queue.py",
    "random.py",
    "shutil.py",
    "statistics.py",
    "string.py",
    "tempfile.py",
    "textwrap.py",
)
# Newline and printable ASCII; anything else (tabs aside) reads as "?".
VOCAB = "\n" + "".join(chr(c) for c in range(32, 127))


def load_corpus(max_bytes: int) -> str:
    """The text of CORPUS_MODULES from this Python's standard library, at most ``max_bytes``."""
    stdlib = os.path.dirname(os.__file__)
    parts, size = [], 0
    for name in sorted(CORPUS_MODULES):
        path = os.path.join(stdlib, name)
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f"# ---- {name}\n" + f.read().replace("\t", "    ")
        parts.append(text[: max_bytes - size])
        size += len(parts[-1])
        if size >= max_bytes:
            break
    if not parts:
        raise SystemExit(f"No standard-library source found in {stdlib}.")
    return "".join(parts)


def encode(text: str):
    import numpy as np

    index = {c: i for i, c in enumerate(VOCAB)}
    unknown = index["?"]
    return np.array([index.get(c, unknown) for c in text], dtype="int32")


def decode(ids) -> str:
    return "".join(VOCAB[int(i)] for i in ids)


def define_layers():
    """The model's layer classes (defined here so that absl parses flags before Keras loads)."""
    import keras
    from keras import ops

    @keras.saving.register_keras_serializable(package="gpipe_lm")
    class TokenAndPositionEmbedding(keras.layers.Layer):
        """Token embedding plus a learned embedding of each position (0..max_len-1).

        Args:
            vocab_size: number of token ids.
            max_len: longest sequence the position table covers.
            d_model: embedding width.
        """

        def __init__(self, vocab_size: int, max_len: int, d_model: int, **kwargs):
            super().__init__(**kwargs)
            self.vocab_size, self.max_len, self.d_model = vocab_size, max_len, d_model
            self.tokens = keras.layers.Embedding(vocab_size, d_model, name="tokens")
            self.positions = keras.layers.Embedding(max_len, d_model, name="positions")

        def build(self, input_shape):
            self.tokens.build(input_shape)
            self.positions.build(input_shape)

        def call(self, ids):
            positions = ops.arange(ops.shape(ids)[-1])
            return self.tokens(ids) + self.positions(positions)

        def compute_output_shape(self, input_shape):
            return tuple(input_shape) + (self.d_model,)

        def get_config(self):
            return {
                **super().get_config(),
                "vocab_size": self.vocab_size,
                "max_len": self.max_len,
                "d_model": self.d_model,
            }

    @keras.saving.register_keras_serializable(package="gpipe_lm")
    class TransformerBlock(keras.layers.Layer):
        """A pre-LayerNorm decoder block: x + attention(LN(x)), then x + MLP(LN(x)).

        Args:
            d_model: width of the residual stream.
            num_heads: attention heads; each has d_model / num_heads dimensions.
            mlp_dim: hidden width of the MLP.
            dropout: rate on the attention weights and on both residual branches.
        """

        def __init__(self, d_model: int, num_heads: int, mlp_dim: int, dropout: float = 0.0, **kwargs):
            super().__init__(**kwargs)
            self.d_model, self.num_heads, self.mlp_dim, self.dropout = d_model, num_heads, mlp_dim, dropout
            self.attention_norm = keras.layers.LayerNormalization(epsilon=1e-5, name="attention_norm")
            self.attention = keras.layers.MultiHeadAttention(
                num_heads, d_model // num_heads, dropout=dropout, name="attention"
            )
            self.attention_dropout = keras.layers.Dropout(dropout, name="attention_dropout")
            self.mlp_norm = keras.layers.LayerNormalization(epsilon=1e-5, name="mlp_norm")
            self.mlp_in = keras.layers.Dense(mlp_dim, activation="gelu", name="mlp_in")
            self.mlp_out = keras.layers.Dense(d_model, name="mlp_out")
            self.mlp_dropout = keras.layers.Dropout(dropout, name="mlp_dropout")

        def build(self, input_shape):
            self.attention_norm.build(input_shape)
            self.attention.build(input_shape, input_shape)
            self.mlp_norm.build(input_shape)
            self.mlp_in.build(input_shape)
            self.mlp_out.build(tuple(input_shape[:-1]) + (self.mlp_dim,))

        def call(self, x, training=None):
            h = self.attention_norm(x)
            h = self.attention(h, h, use_causal_mask=True, training=training)
            x = x + self.attention_dropout(h, training=training)
            h = self.mlp_out(self.mlp_in(self.mlp_norm(x)))
            return x + self.mlp_dropout(h, training=training)

        def compute_output_shape(self, input_shape):
            return input_shape

        def get_config(self):
            return {
                **super().get_config(),
                "d_model": self.d_model,
                "num_heads": self.num_heads,
                "mlp_dim": self.mlp_dim,
                "dropout": self.dropout,
            }

    return TokenAndPositionEmbedding, TransformerBlock


def build_layers(
    vocab_size: int, seq_len: int, num_layers: int, d_model: int, num_heads: int, mlp_dim: int, dropout: float
):
    """A plain list of Keras layers: the same list would make a keras.Sequential."""
    import keras

    TokenAndPositionEmbedding, TransformerBlock = define_layers()
    layers = [
        keras.layers.InputLayer(shape=(seq_len,), dtype="int32", name="token_ids"),
        TokenAndPositionEmbedding(vocab_size, seq_len, d_model, name="embedding"),
    ]
    layers += [
        TransformerBlock(d_model, num_heads, mlp_dim, dropout, name=f"block_{i}") for i in range(num_layers)
    ]
    layers += [
        keras.layers.LayerNormalization(epsilon=1e-5, name="final_norm"),
        keras.layers.Dense(vocab_size, name="logits"),
    ]
    return layers


def make_dataset(tokens, start_step: int, end_step: int, batch_size: int, seq_len: int, seed: int):
    """The batches of steps start_step..end_step-1; the batch of step s depends on (seed, s) only."""
    import tensorflow as tf

    corpus = tf.constant(tokens)
    span = tf.range(seq_len + 1)

    def batch(step):
        offsets = tf.random.stateless_uniform(
            [batch_size],
            seed=tf.stack([tf.cast(seed, tf.int64), step]),
            maxval=len(tokens) - seq_len - 1,
            dtype=tf.int32,
        )
        windows = tf.gather(corpus, offsets[:, None] + span[None, :])
        return windows[:, :-1], windows[:, 1:]

    return tf.data.Dataset.range(start_step, end_step).map(batch).prefetch(2)


def held_out(tokens, seq_len: int, count: int = 64):
    """``count`` evenly spaced windows of the held-out text: inputs and next-token targets."""
    import numpy as np

    starts = np.linspace(0, len(tokens) - seq_len - 1, count).astype("int64")
    windows = np.stack([tokens[s : s + seq_len + 1] for s in starts])
    return windows[:, :-1], windows[:, 1:]


def summary_writer_helpers(log_dir: str):
    """``scalar(tag, value, step)`` and ``text(tag, value)`` writing TensorBoard events.

    They use ``tf.summary.write`` with the scalars/text plugin metadata, which
    works whether or not the ``tensorboard`` package is installed.
    """
    import tensorflow as tf
    from tensorflow.core.framework import summary_pb2

    def metadata(plugin):
        return summary_pb2.SummaryMetadata(
            plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name=plugin)
        )

    writer = tf.summary.create_file_writer(log_dir)

    def scalar(tag, value, step):
        with writer.as_default():
            tf.summary.write(
                tag, tf.constant(float(value), tf.float32), step=step, metadata=metadata("scalars")
            )
        writer.flush()

    def text(tag, value, step=0):
        with writer.as_default():
            tf.summary.write(tag, tf.constant(value), step=step, metadata=metadata("text"))
        writer.flush()

    return scalar, text


def make_callbacks(model, tokens_per_example, manager, step_var, log_dir):
    """Throughput in the logs, per-step loss printing, the simulated kill, checkpoints, TensorBoard."""
    import keras

    class Throughput(keras.callbacks.Callback):
        """Adds examples_per_sec and tokens_per_sec (this epoch so far) to the logs.

        It times each step from batch begin to batch end, leaving out the very
        first step (tracing) and the checkpointing and logging between epochs.
        """

        def __init__(self):
            super().__init__()
            self.first = True

        def on_epoch_begin(self, epoch, logs=None):
            self.examples, self.seconds = 0, 0.0

        def on_train_batch_begin(self, batch, logs=None):
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            elapsed = time.perf_counter() - self.start
            if self.first:
                self.first = False
            else:
                self.examples += FLAGS.batch_size
                self.seconds += elapsed
            self._log(logs)

        def on_epoch_end(self, epoch, logs=None):
            self._log(logs)

        def _log(self, logs):
            if logs is not None and self.seconds > 0:
                logs["examples_per_sec"] = self.examples / self.seconds
                logs["tokens_per_sec"] = self.examples * tokens_per_example / self.seconds

    class StepLog(keras.callbacks.Callback):
        """Prints each step's loss (--print_step_losses) and simulates a kill (--stop_after_steps)."""

        def on_train_batch_end(self, batch, logs=None):
            step = int(model.optimizer.iterations.numpy())
            if FLAGS.print_step_losses:
                print(f"STEP_LOSS {step} {float(logs['batch_loss']):.9g}", flush=True)
            if FLAGS.stop_after_steps and step >= FLAGS.stop_after_steps:
                print(f"\nSIMULATED KILL after step {step}: no checkpoint, no export.", flush=True)
                os._exit(0)  # like a kill: no epoch end, no clean-up

    class Checkpoint(keras.callbacks.Callback):
        """Saves model, optimizer and step after every epoch (= --checkpoint_every steps)."""

        def on_epoch_end(self, epoch, logs=None):
            step = int(model.optimizer.iterations.numpy())
            step_var.assign(step)
            manager.save(checkpoint_number=step)

    return [Throughput(), StepLog(), Checkpoint(), tensorboard_callback(log_dir)]


def tensorboard_callback(log_dir: str):
    """keras.callbacks.TensorBoard, or a stand-in writing the same epoch scalars if the
    ``tensorboard`` package (which Keras' callback writes through) is not installed."""
    import keras

    try:
        import tensorboard  # noqa: F401
    except ImportError:
        print(
            "Note: the tensorboard package is not installed; writing the epoch scalars with "
            "tf.summary.write instead of keras.callbacks.TensorBoard."
        )

        class EpochScalars(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.train, _ = summary_writer_helpers(os.path.join(log_dir, "train"))
                self.validation, _ = summary_writer_helpers(os.path.join(log_dir, "validation"))

            def on_epoch_end(self, epoch, logs=None):
                for key, value in (logs or {}).items():
                    if key.startswith("val_"):
                        self.validation("epoch_" + key[4:], value, epoch)
                    else:
                        self.train("epoch_" + key, value, epoch)

        return EpochScalars()
    return keras.callbacks.TensorBoard(log_dir=log_dir, update_freq="epoch", write_graph=False)


def make_batch_loss():
    import keras

    class BatchLoss(keras.metrics.Metric):
        """The loss of the last batch alone (Keras' ``loss`` is the mean over the epoch so far)."""

        def __init__(self, name="batch_loss", **kwargs):
            super().__init__(name=name, **kwargs)
            self.value = self.add_variable(shape=(), initializer="zeros", name="value")

        def update_state(self, y_true, y_pred, sample_weight=None):
            losses = keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)
            self.value.assign(keras.ops.mean(losses))

        def result(self):
            return self.value

    return BatchLoss()


def generate(model, prompt_ids, length: int, seq_len: int, temperature: float, seed: int):
    """Characters from ``model`` one at a time; the context is the last ``seq_len`` tokens.

    The window is right-padded to ``seq_len`` so every call has one shape; with
    causal attention the padding never reaches the position that is read.
    """
    import numpy as np
    import tensorflow as tf

    step = tf.function(lambda x: model(x, training=False), reduce_retracing=True)
    rng = np.random.default_rng(seed)
    ids = list(prompt_ids)
    for _ in range(length):
        window = ids[-seq_len:]
        x = np.zeros((1, seq_len), dtype="int32")
        x[0, : len(window)] = window
        logits = step(x).numpy()[0, len(window) - 1].astype("float64")
        if temperature <= 0:
            nxt = int(np.argmax(logits))
        else:
            p = np.exp((logits - logits.max()) / temperature)
            nxt = int(rng.choice(len(p), p=p / p.sum()))
        ids.append(nxt)
    return ids


def main(argv):
    del argv  # unused
    logging.set_verbosity(logging.WARNING)  # absl would print TensorFlow's INFO lines (checkpointing)
    # Logical devices must be configured before TensorFlow runs its first op.
    pipeline_flags.setup_devices(FLAGS)

    import keras
    import numpy as np
    import tensorflow as tf

    import tf_gpipe

    keras.utils.set_random_seed(FLAGS.seed)
    os.makedirs(FLAGS.model_dir, exist_ok=True)

    text = load_corpus(FLAGS.corpus_kb * 1000)
    tokens = encode(text)
    split = int(len(tokens) * 0.95)
    train_tokens, val_tokens = tokens[:split], tokens[split:]
    x_val, y_val = held_out(val_tokens, FLAGS.seq_len)
    print(
        f"Corpus: {len(text) / 1000:.0f} kB of Python standard-library source "
        f"({len(train_tokens)} training characters, {len(val_tokens)} held out), "
        f"vocabulary of {len(VOCAB)} characters."
    )

    layers = build_layers(
        len(VOCAB),
        FLAGS.seq_len,
        FLAGS.num_layers,
        FLAGS.d_model,
        FLAGS.num_heads,
        FLAGS.mlp_dim,
        FLAGS.dropout,
    )
    warmup = min(FLAGS.warmup_steps, FLAGS.steps // 2)
    schedule = keras.optimizers.schedules.CosineDecay(
        0.0, FLAGS.steps - warmup, alpha=0.1, warmup_target=FLAGS.learning_rate, warmup_steps=warmup
    )
    optimizer = keras.optimizers.Adam(schedule, global_clipnorm=1.0)
    # With --plan_memory_budget the planner picks K (up to --num_stages), cuts, M, remat, schedule.
    model, settings = pipeline_flags.pipeline_model(
        layers,
        x_val[: FLAGS.batch_size],  # token ids: the embedding needs integers, not a shape
        FLAGS.batch_size,
        optimizer=optimizer,  # its slots, and its update's temporaries (measured)
        name="gpipe_lm",
    )
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[make_batch_loss()],
    )
    optimizer.build(model.trainable_variables)  # so that a restore fills existing variables

    K, M = model.num_stages, model.num_micro_batches
    params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    print(
        f"PipelineModel: {params:,} parameters, K={K} stages, M={M} micro-batches "
        f"(micro-batch of {math.ceil(FLAGS.batch_size / M)} sequences), schedule={model.schedule!r}, "
        f"remat={model.remat!r}, bubble (K-1)/(M+K-1) = {tf_gpipe.bubble_fraction(K, M):.3f}"
    )
    for cell in model.cells:
        print(f"  stage {cell.index} on {cell.device}: {', '.join(layer.name for layer in cell.layers)}")

    # Everything a resumed run needs: the weights (model), Adam's moments and step count
    # (optimizer), the step the checkpoint was taken at, and the state of every dropout's
    # SeedGenerator, so that the resumed run draws the same masks. Neither
    # tf.train.Checkpoint(model) nor save_weights reaches the SeedGenerators (model.weights
    # leaves them out); model.variables has them.
    step_var = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
    checkpoint = tf.train.Checkpoint(
        model=model, optimizer=optimizer, step=step_var, variables=list(model.variables)
    )
    manager = tf.train.CheckpointManager(
        checkpoint, os.path.join(FLAGS.model_dir, "checkpoints"), max_to_keep=FLAGS.max_to_keep
    )
    start_step = 0
    if manager.latest_checkpoint:
        checkpoint.restore(manager.latest_checkpoint).assert_existing_objects_matched()
        start_step = int(step_var.numpy())
        if start_step % FLAGS.checkpoint_every or start_step > FLAGS.steps:
            raise SystemExit(
                f"{manager.latest_checkpoint} is at step {start_step}, which does not fit "
                f"--steps={FLAGS.steps} --checkpoint_every={FLAGS.checkpoint_every}: resume with the "
                "flags of the interrupted run, or use a new --model_dir."
            )
        print(f"Resuming from {manager.latest_checkpoint} (step {start_step} of {FLAGS.steps}).")

    log_dir = os.path.join(FLAGS.model_dir, "logs")
    _, write_text = summary_writer_helpers(log_dir)
    described = {
        **settings,
        "devices": model.devices,
        "balance": model.balance,
        "batch_size": FLAGS.batch_size,
        "seq_len": FLAGS.seq_len,
    }
    write_text(
        "pipeline_settings", "\n\n".join(f"**{k}**: `{v}`" for k, v in described.items()), step=start_step
    )

    initial_val_loss = model.evaluate(x_val, y_val, batch_size=len(x_val), verbose=0)[0]
    print(
        f"Held-out loss before training: {initial_val_loss:.4f} "
        f"({initial_val_loss / math.log(2):.3f} bits per character)"
    )

    history = {}
    train_seconds = 0.0
    if start_step < FLAGS.steps:
        callbacks = make_callbacks(model, FLAGS.seq_len, manager, step_var, log_dir)
        start = time.perf_counter()
        result = model.fit(
            make_dataset(train_tokens, start_step, FLAGS.steps, FLAGS.batch_size, FLAGS.seq_len, FLAGS.seed),
            epochs=FLAGS.steps // FLAGS.checkpoint_every,
            initial_epoch=start_step // FLAGS.checkpoint_every,
            steps_per_epoch=FLAGS.checkpoint_every,
            validation_data=(x_val, y_val),
            validation_batch_size=len(x_val),
            callbacks=callbacks,
            shuffle=False,
            verbose=FLAGS.verbose,
        )
        train_seconds = time.perf_counter() - start
        history = result.history
        print("\nLoss curve (one epoch = --checkpoint_every steps):")
        print("   step  train loss  held-out loss  tokens/s")
        first_epoch = start_step // FLAGS.checkpoint_every
        for i, loss in enumerate(history["loss"]):
            step = (first_epoch + i + 1) * FLAGS.checkpoint_every
            print(
                f"  {step:5d}  {loss:10.4f}  {history['val_loss'][i]:13.4f}  "
                f"{history.get('tokens_per_sec', [float('nan')] * (i + 1))[i]:8.0f}"
            )
        print(
            f"Checkpoints kept: {', '.join(os.path.basename(p) for p in manager.checkpoints)} "
            f"in {manager.directory}"
        )
    else:
        print(f"Training already complete at step {start_step}: exporting and sampling only.")

    final_val_loss = model.evaluate(x_val, y_val, batch_size=len(x_val), verbose=0)[0]
    print(
        f"\nHeld-out loss after training: {final_val_loss:.4f} "
        f"({final_val_loss / math.log(2):.3f} bits per character)"
        + (f"; trained {FLAGS.steps - start_step} steps in {train_seconds:.1f} s" if history else "")
    )

    # Train pipelined, serve unsplit: same layers and weights, no placement, no micro-batches.
    export_path = os.path.join(FLAGS.model_dir, "lm.keras")
    model.to_sequential(name="lm_unsplit").save(export_path)
    exported = keras.saving.load_model(export_path)
    with tf_gpipe.exact_float32():  # no TF32 on GPUs: compare the same float32 arithmetic
        pipelined_logits = model(x_val[:8], training=False).numpy()
        diff = float(np.max(np.abs(pipelined_logits - exported(x_val[:8], training=False).numpy())))
    print(
        f"Exported the unsplit model to {export_path}; reloaded, its logits differ from the "
        f"pipelined model's by at most {diff:.2e}."
    )
    if diff > 1e-4:
        raise SystemExit("The exported model does not reproduce the pipelined model.")

    sample_ids = generate(
        exported, encode(FLAGS.prompt), FLAGS.sample_length, FLAGS.seq_len, FLAGS.temperature, FLAGS.seed
    )
    sample = decode(sample_ids)
    how = "greedy" if FLAGS.temperature <= 0 else f"temperature {FLAGS.temperature}"
    print(f"\nSample from the exported model ({how}):\n{'-' * 60}\n{sample}\n{'-' * 60}")

    summary = {
        "start_step": start_step,
        "steps": FLAGS.steps,
        "train_loss_per_epoch": [round(float(v), 6) for v in history.get("loss", [])],
        "val_loss_per_epoch": [round(float(v), 6) for v in history.get("val_loss", [])],
        "tokens_per_sec": [round(float(v), 1) for v in history.get("tokens_per_sec", [])],
        "initial_val_loss": round(float(initial_val_loss), 6),
        "final_val_loss": round(float(final_val_loss), 6),
        "devices": model.devices,
        "balance": model.balance,
        "export_path": export_path,
        "export_max_abs_diff": diff,
        "train_seconds": round(train_seconds, 2),
        "sample": sample,
    }
    print("SUMMARY " + json.dumps(summary))


if __name__ == "__main__":
    app.run(main)
