"""Compiled stages: XLA per stage, first-step (trace + compile) time, and the cost of the
pipeline machinery against plain Keras doing the same micro-batching.

Model: a stack of small pre-LN Transformer blocks (``--blocks`` x d=``--width``,
sequence ``--seq``, 4 heads) on a token-embedding input, Adam. Three measurements:

* ``xla``: ``PipelineModel(K=1, M=1, remat="never")`` against ``keras.Sequential`` on the
  same layers and weights, both ``compile(jit_compile=...)`` with ``--jit`` (True, False or
  "auto", Keras' default); ``train_on_batch`` steps alternated A/B/A/B in one process,
  ``--rounds`` rounds of ``--steps`` steps each; medians of the per-round step times and
  the median of the per-round ratios.
* ``first``: the first ``train_on_batch`` (trace, compile, run) of ``PipelineModel(K=4)`` for
  each M in ``--micro_batches``, and of ``keras.Sequential``; each in a fresh process (a
  warm process would reuse traces), ``--repeats`` times, median.
* ``accum``: a steady step of ``PipelineModel(K=4, M=16)`` against a ``keras.Model`` whose
  ``train_step`` cuts the batch into the same 16 micro-batches, sums their gradients and
  applies them once (the same arithmetic with no pipeline), alternated A/B, medians.

On a CPU-only machine the K stages sit on K logical CPUs (one thread pool: placement, not
speed-up). With ``--gpu`` the script expects a GPU and splits it into K logical GPUs of
``--gpu_memory_mb`` each for the K>1 rows. Run from the repository root:

    python benchmarks/compiled_stages/compiled_stages.py --mode=xla,first,accum

Prints Markdown tables; ``--out`` also saves them as JSON. Never run by the tests.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import harness  # also puts the repo root on sys.path
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_list("mode", ["xla", "first", "accum"], "Measurements to run: xla, first, accum.")
flags.DEFINE_integer("blocks", 8, "Transformer blocks.")
flags.DEFINE_integer("width", 128, "Model width d.")
flags.DEFINE_integer("seq", 64, "Sequence length.")
flags.DEFINE_integer("batch", 32, "Mini-batch size.")
flags.DEFINE_integer("vocab", 512, "Vocabulary size.")
flags.DEFINE_string("jit", "True", "jit_compile for both models in the xla measurement: True, False, auto.")
flags.DEFINE_integer("rounds", 15, "A/B rounds.")
flags.DEFINE_integer("steps", 5, "Steps per model per round.")
flags.DEFINE_list("micro_batches", ["1", "4", "16", "32"], "M values for the first-step measurement.")
flags.DEFINE_integer("stages", 4, "K for the first-step and accum measurements.")
flags.DEFINE_integer("accum_m", 16, "M for the accum measurement.")
flags.DEFINE_string(
    "accum_remat",
    "never",
    "remat of the pipeline in the accum measurement (never: same arithmetic as plain accumulation).",
)
flags.DEFINE_integer("repeats", 1, "Fresh processes per first-step configuration.")
flags.DEFINE_bool("gpu", False, "Split the GPU into --stages logical GPUs for the K>1 rows.")
flags.DEFINE_integer("gpu_memory_mb", 16000, "Memory of each logical GPU with --gpu.")
flags.DEFINE_string("out", "", "Write the results as JSON here.")
flags.DEFINE_string("child", "", "Internal: run one first-step measurement and print it.")


def _jit(text):
    return {"true": True, "false": False}.get(text.lower(), text)


def _setup_devices(k):
    import tensorflow as tf

    if FLAGS.gpu:
        gpus = tf.config.list_physical_devices("GPU")
        tf.config.set_logical_device_configuration(
            gpus[0], [tf.config.LogicalDeviceConfiguration(memory_limit=FLAGS.gpu_memory_mb)] * k
        )
        return [d.name for d in tf.config.list_logical_devices("GPU")][:k]
    import tf_gpipe

    return tf_gpipe.configure_virtual_cpus(k)


def _layers(seed=0):
    import keras

    keras.utils.set_random_seed(seed)
    d = FLAGS.width

    @keras.saving.register_keras_serializable(package="bench")
    class Block(keras.layers.Layer):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.ln1, self.ln2 = keras.layers.LayerNormalization(), keras.layers.LayerNormalization()
            self.att = keras.layers.MultiHeadAttention(4, d // 4)
            self.up, self.down = keras.layers.Dense(4 * d, activation="gelu"), keras.layers.Dense(d)

        def call(self, x):
            h = self.ln1(x)
            x = x + self.att(h, h, use_causal_mask=True)
            return x + self.down(self.up(self.ln2(x)))

    return (
        [keras.Input((FLAGS.seq,), dtype="int32"), keras.layers.Embedding(FLAGS.vocab, d)]
        + [Block() for _ in range(FLAGS.blocks)]
        + [keras.layers.Dense(FLAGS.vocab)]
    )


def _data():
    import numpy as np

    rng = np.random.RandomState(0)
    x = rng.randint(0, FLAGS.vocab, (FLAGS.batch, FLAGS.seq)).astype("int32")
    return x, rng.randint(0, FLAGS.vocab, (FLAGS.batch, FLAGS.seq)).astype("int32")


def _compile(model, jit):
    import keras

    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit,
    )


def _pipeline(k, m, devices, remat="always"):
    import tf_gpipe

    return tf_gpipe.PipelineModel(_layers(), num_stages=k, num_micro_batches=m, devices=devices, remat=remat)


def _accumulating(m):
    """Plain Keras with the same micro-batching: M slices, gradients summed, one update."""
    import keras
    import tensorflow as tf

    class Accumulating(keras.Sequential):
        def train_step(self, data):
            x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
            sizes = [len(a) for a in __import__("numpy").array_split(range(FLAGS.batch), m)]
            xs, ys = tf.split(x, sizes), tf.split(y, sizes)
            total = None
            for xm, ym, n in zip(xs, ys, sizes):
                with tf.GradientTape() as tape:
                    loss = self.compute_loss(x=xm, y=ym, y_pred=self(xm, training=True)) * (n / FLAGS.batch)
                grads = [tf.convert_to_tensor(g) for g in tape.gradient(loss, self.trainable_variables)]
                total = grads if total is None else [a + b for a, b in zip(total, grads)]
            self.optimizer.apply_gradients(zip(total, self.trainable_variables))
            return {}

    return Accumulating(_layers())


def _alternate(models, x, y):
    """Per-round median step time of each model, steps alternated between them."""
    for model in models.values():  # trace and warm up
        for _ in range(3):
            model.train_on_batch(x, y)
    times = {name: [] for name in models}
    for r in range(FLAGS.rounds):
        order = list(models) if r % 2 == 0 else list(reversed(models))
        for name in order:
            start = time.perf_counter()
            for _ in range(FLAGS.steps):
                models[name].train_on_batch(x, y)
            times[name].append((time.perf_counter() - start) / FLAGS.steps)
    return times


def _ratio_rows(times, baseline):
    rows = []
    for name, t in times.items():
        paired = statistics.median(a / b for a, b in zip(t, times[baseline]))
        rows.append([name, f"{1e3 * statistics.median(t):.1f}", f"{paired:.3f}"])
    return rows


def measure_xla():
    import keras
    import tensorflow as tf

    x, y = _data()
    jit = _jit(FLAGS.jit)
    pipe = _pipeline(1, 1, ["/device:GPU:0" if FLAGS.gpu else "/device:CPU:0"], remat="never")
    seq = keras.Sequential(_layers())
    seq.set_weights(pipe.get_weights())
    plain = keras.Sequential(_layers())
    _compile(pipe, jit)
    _compile(seq, jit)
    _compile(plain, False)
    with tf.device("/device:GPU:0" if FLAGS.gpu else "/device:CPU:0"):
        times = _alternate(
            {"PipelineModel K=1 M=1": pipe, "keras.Sequential": seq, "Sequential jit=False": plain}, x, y
        )
    print(f"\n### XLA: jit_compile={jit!r} for both (Sequential jit=False for context)\n")
    print(
        harness.md_table(
            ["model", "median step (ms)", "ratio to Sequential (paired median)"],
            _ratio_rows(times, "keras.Sequential"),
        )
    )
    return {"jit": str(jit), "times_s": times}


def _first_child(spec):
    kind, m = spec.split(":")
    devices = _setup_devices(FLAGS.stages)
    import keras

    x, y = _data()
    model = keras.Sequential(_layers()) if kind == "seq" else _pipeline(FLAGS.stages, int(m), devices)
    _compile(model, _jit(FLAGS.jit))
    start = time.perf_counter()
    model.train_on_batch(x, y)
    first = time.perf_counter() - start
    start = time.perf_counter()
    model.train_on_batch(x, y)
    harness.emit({"first_s": first, "second_s": time.perf_counter() - start}, tag="CHILD ")


def measure_first():
    specs = ["seq:0"] + [f"pipe:{m}" for m in FLAGS.micro_batches]
    results = {s: [] for s in specs}
    flags_out = harness.flag_args(("blocks", "width", "seq", "batch", "vocab", "jit", "stages"))
    for _ in range(FLAGS.repeats):
        for spec in specs:
            args = [f"--child={spec}", *flags_out] + (["--gpu"] if FLAGS.gpu else [])
            out, lines = harness.run_child(__file__, args, dict(os.environ), tag="CHILD ")
            if not lines:
                raise SystemExit(f"{spec} failed:\n{out.stderr[-3000:]}")
            results[spec].append(lines[0])
    seq_first = statistics.median(r["first_s"] for r in results["seq:0"])
    m1 = statistics.median(r["first_s"] for r in results[specs[1]])
    rows = []
    for spec in specs:
        first = statistics.median(r["first_s"] for r in results[spec])
        second = statistics.median(r["second_s"] for r in results[spec])
        name = "keras.Sequential" if spec == "seq:0" else f"PipelineModel K={FLAGS.stages} M={spec[5:]}"
        rows.append(
            [
                name,
                f"{first:.1f}",
                f"{first / seq_first:.2f}",
                "" if spec == "seq:0" else f"{first / m1:.2f}",
                f"{1e3 * second:.0f}",
            ]
        )
    print(f"\n### First train_on_batch (trace + compile + run), jit_compile={FLAGS.jit}\n")
    print(
        harness.md_table(
            [
                "model",
                "first step (s)",
                "vs Sequential",
                f"vs M={FLAGS.micro_batches[0]}",
                "second step (ms)",
            ],
            rows,
        )
    )
    return results


def measure_accum():
    import tensorflow as tf

    devices = _setup_devices(FLAGS.stages)
    x, y = _data()
    pipe = _pipeline(FLAGS.stages, FLAGS.accum_m, devices, remat=FLAGS.accum_remat)
    plain = _accumulating(FLAGS.accum_m)
    plain.set_weights(pipe.get_weights())
    jit = _jit(FLAGS.jit)
    _compile(pipe, jit)
    _compile(plain, jit)
    with tf.device(devices[0]):
        times = _alternate(
            {
                f"PipelineModel K={FLAGS.stages} M={FLAGS.accum_m}": pipe,
                f"Keras, {FLAGS.accum_m} micro-batches summed": plain,
            },
            x,
            y,
        )
    print(
        f"\n### Steady step, jit_compile={jit!r}, remat={FLAGS.accum_remat!r}: "
        "pipeline vs plain micro-batching\n"
    )
    print(
        harness.md_table(
            ["model", "median step (ms)", "ratio (paired median)"],
            _ratio_rows(times, f"Keras, {FLAGS.accum_m} micro-batches summed"),
        )
    )
    return {"times_s": times}


def main(argv):
    del argv
    if FLAGS.child:
        return _first_child(FLAGS.child)
    harness.header("Compiled stages", __name__, skip=("child",))
    results = {}
    if "first" in FLAGS.mode:  # fresh processes: run before this one initializes TensorFlow
        results["first"] = measure_first()
    if "accum" in FLAGS.mode or "xla" in FLAGS.mode:
        if "accum" in FLAGS.mode:
            results["accum"] = measure_accum()
        else:
            _setup_devices(1)
        if "xla" in FLAGS.mode:
            results["xla"] = measure_xla()
    print(f"\nload after: {harness.loadavg()}")
    if FLAGS.out:
        harness.save_json(FLAGS.out, results)


if __name__ == "__main__":
    app.run(main)
