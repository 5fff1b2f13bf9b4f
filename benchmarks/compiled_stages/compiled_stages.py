"""Compiled stages: XLA per stage, first-step (trace + compile) time, and the cost of the
pipeline machinery against plain Keras doing the same micro-batching.

Model: ``--blocks`` small pre-LN Transformer blocks (d=``--width``, sequence ``--seq``, 4 heads)
on a token embedding, Adam. Three measurements (``--mode``):

* ``xla``: ``PipelineModel(K=1, M=1, remat="never")`` against ``keras.Sequential`` on the same
  weights, both ``compile(jit_compile=--jit)``; steps alternated A/B in one process, ``--rounds``
  rounds of ``--steps`` steps; medians of the per-round step times and of the per-round ratios.
* ``first``: the first ``train_on_batch`` (trace, compile, run) of ``PipelineModel(K=4)`` for
  each M in ``--micro_batches``, and of ``keras.Sequential``; each in a fresh process,
  ``--repeats`` times, median.
* ``accum``: a steady step of ``PipelineModel(K=4, M=16)`` against a ``keras.Sequential`` whose
  ``train_step`` sums the gradients of the same 16 micro-batches and applies them once.
* ``loop``: a steady step of ``PipelineModel(K=4, M=--accum_m)`` (``--loop_schedule``,
  ``--loop_remat``) built as loops over micro-batches (``tf_gpipe.micro_batch_loop``) against
  the same step built out (one call per (stage, micro-batch)), alternated A/B in one process.

``--first_builders=built_out,loop`` measures the first step both ways (``micro_batch_loops=True``:
GPipe with every stage re-materialized, ``remat="always"`` here, and M >= 2).

On a CPU the K stages sit on K logical CPUs (placement, not speed-up); with ``--gpu`` the GPU
is split into K logical GPUs of ``--gpu_memory_mb``. Results: benchmarks/compiled_stages/README.md.
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
flags.DEFINE_list("mode", ["xla", "first", "accum"], "Measurements to run: xla, first, accum, loop.")
flags.DEFINE_list(
    "first_builders", ["built_out", "loop"], "How the first-step rows build GPipe's step: built_out, loop."
)
flags.DEFINE_bool("gpipe_loop", False, "Internal (child): PipelineModel(micro_batch_loops=True) (M >= 2).")
flags.DEFINE_integer("blocks", 8, "Transformer blocks.")
flags.DEFINE_integer("width", 128, "Model width d.")
flags.DEFINE_integer("seq", 64, "Sequence length.")
flags.DEFINE_integer("batch", 32, "Mini-batch size.")
flags.DEFINE_integer("vocab", 512, "Vocabulary size.")
flags.DEFINE_string("jit", "True", "jit_compile of the models (xla, first, accum): True, False, auto.")
flags.DEFINE_integer("rounds", 15, "A/B rounds.")
flags.DEFINE_integer("steps", 5, "Steps per model per round.")
flags.DEFINE_list("micro_batches", ["1", "4", "16", "32"], "M values for the first-step measurement.")
flags.DEFINE_integer("stages", 4, "K for the first-step and accum measurements.")
flags.DEFINE_integer("accum_m", 16, "M for the accum measurement.")
flags.DEFINE_string("accum_remat", "never", "remat of the pipeline in the accum measurement.")
flags.DEFINE_string("loop_schedule", "gpipe", "Schedule of the loop measurement.")
flags.DEFINE_string("loop_remat", "always", "remat of the loop measurement.")
flags.DEFINE_integer("repeats", 1, "Fresh processes per first-step configuration.")
flags.DEFINE_bool("gpu", False, "Split the GPU into --stages logical GPUs for the K>1 rows.")
flags.DEFINE_integer("gpu_memory_mb", 16000, "Memory of each logical GPU with --gpu.")
flags.DEFINE_string("out", "", "Write the results as JSON here.")
flags.DEFINE_bool("child", False, "Internal: one first-step measurement (M=0: keras.Sequential).")


def _jit():
    return {"true": True, "false": False}.get(FLAGS.jit.lower(), FLAGS.jit)


def _setup_devices(k):
    import tensorflow as tf

    import tf_gpipe

    if not FLAGS.gpu:
        return tf_gpipe.configure_virtual_cpus(k)
    config = [tf.config.LogicalDeviceConfiguration(memory_limit=FLAGS.gpu_memory_mb)] * k
    tf.config.set_logical_device_configuration(tf.config.list_physical_devices("GPU")[0], config)
    return [d.name for d in tf.config.list_logical_devices("GPU")][:k]


def _model(kind, k=1, m=1, devices=None, remat="always", jit=None, micro_batch_loops=False, schedule="gpipe"):
    """A compiled model on the same seeded layers: "pipe", "seq" or "accum" (plain micro-batching)."""
    import keras
    import numpy as np
    import tensorflow as tf

    import tf_gpipe

    keras.utils.set_random_seed(0)
    d = FLAGS.width

    class Accumulating(keras.Sequential):
        def train_step(self, data):
            x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
            sizes = [len(a) for a in np.array_split(range(FLAGS.batch), m)]
            total = None
            for xm, ym, n in zip(tf.split(x, sizes), tf.split(y, sizes), sizes):
                with tf.GradientTape() as tape:
                    loss = self.compute_loss(x=xm, y=ym, y_pred=self(xm, training=True)) * (n / FLAGS.batch)
                grads = [tf.convert_to_tensor(g) for g in tape.gradient(loss, self.trainable_variables)]
                total = grads if total is None else [a + b for a, b in zip(total, grads)]
            self.optimizer.apply_gradients(zip(total, self.trainable_variables))
            return {}

    layers = [keras.Input((FLAGS.seq,), dtype="int32"), keras.layers.Embedding(FLAGS.vocab, d)]
    layers += [harness.transformer_block(d) for _ in range(FLAGS.blocks)] + [keras.layers.Dense(FLAGS.vocab)]
    if kind == "pipe":
        model = tf_gpipe.PipelineModel(
            layers,
            num_stages=k,
            num_micro_batches=m,
            devices=devices,
            remat=remat,
            micro_batch_loops=micro_batch_loops,
            schedule=schedule,
            virtual_stages=2 if schedule == "interleaved" else 1,
        )
    else:
        model = (Accumulating if kind == "accum" else keras.Sequential)(layers)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3), loss=loss, jit_compile=_jit() if jit is None else jit
    )
    return model


def _data():
    import numpy as np

    rng = np.random.RandomState(0)
    x = rng.randint(0, FLAGS.vocab, (FLAGS.batch, FLAGS.seq)).astype("int32")
    return x, rng.randint(0, FLAGS.vocab, (FLAGS.batch, FLAGS.seq)).astype("int32")


def _alternate(models, baseline, title):
    """Per-round median step time of each model, steps alternated between them; print the table."""
    x, y = _data()
    for model in models.values():  # trace and warm up
        for _ in range(3):
            model.train_on_batch(x, y)
    times = {name: [] for name in models}
    for r in range(FLAGS.rounds):
        for name in list(models) if r % 2 == 0 else list(reversed(models)):
            start = time.perf_counter()
            for _ in range(FLAGS.steps):
                models[name].train_on_batch(x, y)
            times[name].append((time.perf_counter() - start) / FLAGS.steps)
    rows = []
    for name, t in times.items():
        paired = statistics.median(a / b for a, b in zip(t, times[baseline]))
        rows.append([name, f"{1e3 * statistics.median(t):.1f}", f"{paired:.3f}"])
    harness.print_table("model|median step (ms)|ratio (paired median)", rows, title)
    return times


def measure_xla():
    import tensorflow as tf

    device = "/device:GPU:0" if FLAGS.gpu else "/device:CPU:0"
    pipe = _model("pipe", devices=[device], remat="never")
    seq = _model("seq")
    seq.set_weights(pipe.get_weights())
    models = {
        "PipelineModel K=1 M=1": pipe,
        "keras.Sequential": seq,
        "Sequential jit=False": _model("seq", jit=False),
    }
    with tf.device(device):
        title = f"### XLA: jit_compile={_jit()!r} for both (Sequential jit=False for context)"
        return {"jit": str(_jit()), "times_s": _alternate(models, "keras.Sequential", title)}


def measure_first():
    keys = [("seq", "0")] + [(b, m) for m in FLAGS.micro_batches for b in FLAGS.first_builders]
    runs: dict = {k: [] for k in keys}
    for _ in range(FLAGS.repeats):
        for builder, m in keys:  # builders alternated per M
            results = harness.child(micro_batches=[m], gpipe_loop=builder == "loop")
            if not results:
                raise SystemExit(f"{builder} M={m} failed")
            runs[builder, m] += results
    first = {k: statistics.median(r["first_s"] for r in rs) for k, rs in runs.items()}
    rows = []
    for (builder, m), rs in runs.items():
        name = "keras.Sequential" if m == "0" else f"PipelineModel K={FLAGS.stages} M={m} ({builder})"
        vs_m1 = "" if m == "0" else f"{first[builder, m] / first[builder, FLAGS.micro_batches[0]]:.2f}"
        second = 1e3 * statistics.median(r["second_s"] for r in rs)
        ratio = first[builder, m] / first["seq", "0"]
        rows.append([name, f"{first[builder, m]:.1f}", f"{ratio:.2f}", vs_m1, f"{second:.0f}"])
    title = f"### First train_on_batch (trace + compile + run), jit_compile={FLAGS.jit}"
    headers = f"model|first step (s)|vs Sequential|vs M={FLAGS.micro_batches[0]}|second step (ms)"
    harness.print_table(headers, rows, title)
    return {f"{builder}:{m}": rs for (builder, m), rs in runs.items()}


def measure_accum():
    import tensorflow as tf

    K, M = FLAGS.stages, FLAGS.accum_m
    devices = _setup_devices(K)
    pipe = _model("pipe", K, M, devices, remat=FLAGS.accum_remat)
    plain = _model("accum", m=M)
    plain.set_weights(pipe.get_weights())
    names = [f"PipelineModel K={K} M={M}", f"Keras, {M} micro-batches summed"]
    title = f"### Steady step, jit_compile={_jit()!r}, remat={FLAGS.accum_remat!r}: "
    title += "pipeline vs plain micro-batching"
    with tf.device(devices[0]):
        return {"times_s": _alternate(dict(zip(names, (pipe, plain))), names[1], title)}


def measure_loop():
    import tensorflow as tf

    K, M = FLAGS.stages, FLAGS.accum_m
    devices = _setup_devices(K)
    models = {}
    x, y = _data()
    for name, micro_batch_loops in (("loop", True), ("built out", False)):
        label = f"PipelineModel K={K} M={M} ({name})"
        models[label] = model = _model(
            "pipe",
            K,
            M,
            devices,
            remat=FLAGS.loop_remat,
            micro_batch_loops=micro_batch_loops,
            schedule=FLAGS.loop_schedule,
        )
        model.train_on_batch(x, y)
    names = list(models)
    models[names[1]].set_weights(models[names[0]].get_weights())
    title = (
        f"### Steady step, jit_compile={_jit()!r}, schedule={FLAGS.loop_schedule!r}, "
        f"remat={FLAGS.loop_remat!r}: loops over micro-batches vs built out"
    )
    with tf.device(devices[0]):
        return {"times_s": _alternate(models, names[1], title)}


def main(argv):
    del argv
    if FLAGS.child:  # one first step in a fresh process (a warm process would reuse traces)
        m = int(FLAGS.micro_batches[0])
        devices = _setup_devices(FLAGS.stages)
        looped = FLAGS.gpipe_loop and m > 1
        model = _model("pipe", FLAGS.stages, m, devices, micro_batch_loops=looped) if m else _model("seq")
        x, y = _data()
        start = time.perf_counter()
        model.train_on_batch(x, y)
        first = time.perf_counter() - start
        model.train_on_batch(x, y)
        return harness.emit({"first_s": first, "second_s": time.perf_counter() - start - first})
    harness.header("Compiled stages")
    results = {}
    if "first" in FLAGS.mode:  # fresh processes: run before this one initializes TensorFlow
        results["first"] = measure_first()
    if "accum" in FLAGS.mode:
        results["accum"] = measure_accum()
    if "loop" in FLAGS.mode:
        results["loop"] = measure_loop()
    if "xla" in FLAGS.mode and not {"accum", "loop"} & set(FLAGS.mode):
        _setup_devices(1)
    if "xla" in FLAGS.mode:
        results["xla"] = measure_xla()
    print(f"\nload after: {harness.loadavg()}")
    if FLAGS.out:
        harness.save_json(FLAGS.out, results)


if __name__ == "__main__":
    app.run(main)
