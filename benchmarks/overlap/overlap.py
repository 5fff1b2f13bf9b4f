"""Do two pipeline stages on two logical CPUs run at the same time?

A residual MLP (``--blocks`` blocks ``x + Dense(d)(relu(Dense(d)(x)))``, then Dense(10)),
batch ``--batch``, trained with SGD, no XLA. Each setting (TF inter-op / intra-op threads,
``TF_ENABLE_ONEDNN_OPTS``) runs in a fresh child process with ``configure_virtual_cpus(2)``;
there the variants are timed interleaved (``--rounds`` rounds of ``--steps`` steps each, the
order rotating, after ``--warmup`` steps): ``keras.Sequential`` on the whole batch, plain
Keras accumulating M micro-batches (``harness.micro_batched_sequential``), ``PipelineModel``
K=2 M=M remat="never" with the gpipe and 1f1b schedules, and K=1 M=M (the pipeline's
machinery on one device). Reports median ms/step, process CPU time / wall time per step
(2.0: both cores busy) and the pipeline's throughput over plain micro-batching. With
``--trace``, one step of the K=2 gpipe model under tf.profiler gives each
stage's MatMul busy time and how much of it ran while the other stage was in a MatMul too.
Method and results: benchmarks/overlap/README.md.
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
flags.DEFINE_list(
    "settings",
    ["0-0-1", "2-1-1", "4-1-1", "0-0-0", "2-1-0"],
    "'<inter>-<intra>-<onednn>': TF inter-op and intra-op threads (0: TF's default) and "
    "TF_ENABLE_ONEDNN_OPTS, one child process each.",
)
flags.DEFINE_list(
    "variants",
    ["sequential", "plain_mb", "pipe_k2_gpipe", "pipe_k2_1f1b", "pipe_k1"],
    "Which variants to time (also: plain_mb_serial, plain_mb with micro-batches one at a time).",
)
flags.DEFINE_integer("blocks", 16, "Residual blocks.")
flags.DEFINE_integer("width", 512, "d, the blocks' width.")
flags.DEFINE_integer("batch", 256, "Mini-batch size.")
flags.DEFINE_integer("micro_batches", 8, "M.")
flags.DEFINE_integer("rounds", 5, "Interleaved rounds.")
flags.DEFINE_integer("steps", 10, "Steps per variant per round.")
flags.DEFINE_integer("warmup", 5, "Warm-up steps per variant (after the first, tracing, step).")
flags.DEFINE_bool("trace", True, "Trace one step of the K=2 gpipe model (MatMul overlap).")
flags.DEFINE_bool("child", False, "Internal: run one setting in this process.")
flags.DEFINE_string("setting", "0-0-1", "Internal: the child's setting.")
flags.DEFINE_string("out", harness.OUT_DIR, "Directory for the JSON.")

PIPE = "pipe_k2_gpipe"


def parse(setting: str) -> tuple[int, int, str]:
    inter, intra, onednn = setting.split("-")
    return int(inter), int(intra), onednn


def busy(intervals):
    """Merge [start, end) intervals into disjoint ones."""
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def overlap(a, b) -> float:
    """Total length of the intersection of two disjoint, sorted interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def trace_step(model, x, y) -> dict:
    """One step under tf.profiler: per stage (the ``stage<k>`` prefix of each op's name), MatMul
    busy ms and all-op busy ms, the MatMul time during which both stages were in a MatMul, and
    how many TF compute threads ran ops."""
    import glob
    import re
    import tempfile

    import tensorflow as tf

    try:
        from tsl.profiler.protobuf import xplane_pb2
    except ImportError:  # older layout
        from tensorflow.tsl.profiler.protobuf import xplane_pb2

    logdir = tempfile.mkdtemp(prefix="overlap_trace_")
    tf.profiler.experimental.start(logdir)
    model.train_on_batch(x, y)
    tf.profiler.experimental.stop()
    space = xplane_pb2.XSpace()
    with open(sorted(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True))[-1], "rb") as f:
        space.ParseFromString(f.read())
    ops, mm, threads = {}, {}, set()
    for plane in space.planes:
        for line in plane.lines:
            for e in line.events:
                name = plane.event_metadata[e.metadata_id].name
                stage = re.match(r"stage(\d+)", name)
                if ":" not in name or not stage:  # TF op events are "name:type"
                    continue
                s = line.timestamp_ns / 1e6 + e.offset_ps / 1e9
                iv = (s, s + e.duration_ps / 1e9)
                ops.setdefault(f"stage{stage.group(1)}", []).append(iv)
                threads.add(line.name)
                if "MatMul" in name.rsplit(":", 1)[1]:
                    mm.setdefault(f"stage{stage.group(1)}", []).append(iv)
    stages = sorted(ops)
    out: dict = {"stages": stages, "threads": len(threads)}
    if len(stages) < 2:
        return out
    a, b = (busy(mm.get(k, [])) for k in stages[:2])
    out.update(
        span_ms=max(e for k in stages for _, e in ops[k]) - min(s for k in stages for s, _ in ops[k]),
        matmuls={k: len(mm.get(k, [])) for k in stages},
        matmul_busy_ms={k: sum(e - s for s, e in busy(mm.get(k, []))) for k in stages},
        op_busy_ms={k: sum(e - s for s, e in busy(ops[k])) for k in stages},
        matmul_both_ms=overlap(a, b),
        mean_matmul_ms={k: statistics.mean(e - s for s, e in mm[k]) for k in stages if mm.get(k)},
        op_both_ms=overlap(busy(ops[stages[0]]), busy(ops[stages[1]])),
    )
    return out


def run_child() -> None:
    inter, intra, _ = parse(FLAGS.setting)
    import tensorflow as tf

    import tf_gpipe

    tf.config.threading.set_inter_op_parallelism_threads(inter)
    tf.config.threading.set_intra_op_parallelism_threads(intra)
    tf_gpipe.configure_virtual_cpus(2)
    import keras
    import numpy as np

    tf.get_logger().setLevel("ERROR")
    d, M = FLAGS.width, FLAGS.micro_batches

    class Residual(keras.layers.Layer):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.up, self.down = keras.layers.Dense(d, activation="relu"), keras.layers.Dense(d)

        def call(self, x):
            return x + self.down(self.up(x))

    def layers():
        blocks = [Residual() for _ in range(FLAGS.blocks)]
        return [keras.layers.InputLayer(shape=(d,)), *blocks, keras.layers.Dense(10)]

    def compiled(model):
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        model.compile(optimizer=keras.optimizers.SGD(1e-4), loss=loss, jit_compile=False)
        return model

    def pipe(K, schedule="gpipe"):
        devices = ["/device:CPU:0", "/device:CPU:1"][:K]
        return tf_gpipe.PipelineModel(
            layers(), num_stages=K, num_micro_batches=M, devices=devices, remat="never", schedule=schedule
        )

    def serial_mb():
        """plain_mb with each micro-batch's forward after the previous one's gradients: no two
        micro-batches at once (what the dataflow executor may otherwise do in plain_mb)."""
        model = harness.micro_batched_sequential(layers(), M)

        def train_step(data):
            x, y = data[0], data[1]
            n = tf.cast(tf.shape(x)[0], tf.float32)
            total, after, total_loss = None, [], 0.0
            for xi, yi in zip(tf.split(x, M), tf.split(y, M)):
                with tf.control_dependencies(after):
                    xi = tf.identity(xi)
                with tf.GradientTape() as tape:
                    pi = model(xi, training=True)
                    li = model.compute_loss(x=xi, y=yi, y_pred=pi, training=True)
                    li = li * (tf.cast(tf.shape(xi)[0], tf.float32) / n)
                g = tape.gradient(li, model.trainable_variables)
                after = g
                total = g if total is None else [a + b for a, b in zip(total, g)]
                total_loss = total_loss + li
            model.optimizer.apply_gradients(zip(total, model.trainable_variables))
            model._loss_tracker.update_state(total_loss, sample_weight=tf.shape(x)[0])
            return {"loss": model._loss_tracker.result()}

        model.train_step = train_step
        return model

    make = {
        "sequential": lambda: keras.Sequential(layers()),
        "plain_mb": lambda: harness.micro_batched_sequential(layers(), M),
        "plain_mb_serial": serial_mb,
        "pipe_k2_gpipe": lambda: pipe(2),
        "pipe_k2_1f1b": lambda: pipe(2, "1f1b"),
        "pipe_k1": lambda: pipe(1),
    }
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    with tf.device("/device:CPU:0"):
        x = tf.constant(rng.standard_normal((FLAGS.batch, d), dtype=np.float32))
        y = tf.constant(rng.integers(0, 10, FLAGS.batch), dtype=tf.int32)
    variants = {n: compiled(make[n]()) for n in FLAGS.variants}
    for model in variants.values():
        model.train_on_batch(x, y)  # traces
        for _ in range(FLAGS.warmup):
            model.train_on_batch(x, y)
    names = list(variants)
    times = {n: [] for n in names}
    util = {n: [] for n in names}
    for r in range(FLAGS.rounds):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            c0, t0 = time.process_time(), time.perf_counter()
            for _ in range(FLAGS.steps):
                variants[n].train_on_batch(x, y)  # returns numpy logs: synchronizes
            wall = time.perf_counter() - t0
            times[n].append(wall / FLAGS.steps * 1e3)
            util[n].append((time.process_time() - c0) / wall)
    threads = tf.config.threading
    result = dict(
        setting=FLAGS.setting,
        inter=threads.get_inter_op_parallelism_threads(),
        intra=threads.get_intra_op_parallelism_threads(),
        onednn=os.environ.get("TF_ENABLE_ONEDNN_OPTS", "unset"),
        times_ms=times,
        util=util,
    )
    if FLAGS.trace and PIPE in variants:
        traces = [trace_step(variants[PIPE], x, y) for _ in range(3)]
        result["trace"] = traces[-1]
        result["trace_both_ms"] = [t.get("matmul_both_ms") for t in traces]
    harness.emit(result)


def main(argv):
    del argv
    if FLAGS.child:
        return run_child()
    harness.header("tf_gpipe overlap benchmark: K=2 stages on two logical CPUs vs plain micro-batching")
    rows, ratio_rows, trace_rows, runs = [], [], [], []
    for setting in FLAGS.settings:
        _, _, onednn = parse(setting)
        env = dict(harness.child_env(), TF_ENABLE_ONEDNN_OPTS=onednn)
        res = harness.child(env=env, setting=setting)
        if not res:
            continue
        r = res[0]
        runs.append(r)
        med = {n: statistics.median(t) for n, t in r["times_ms"].items()}
        label = f"inter={setting.split('-')[0]} intra={setting.split('-')[1]} oneDNN={r['onednn']}"
        for n in r["times_ms"]:
            rows.append([label, n, f"{med[n]:.1f}", f"{statistics.median(r['util'][n]):.2f}"])
        for base in ("plain_mb", "plain_mb_serial"):
            for n in ("pipe_k2_gpipe", "pipe_k2_1f1b", "pipe_k1"):
                if n in med and base in med:
                    times = r["times_ms"]
                    paired = statistics.median(p / q for p, q in zip(times[base], times[n]))
                    ratio_rows.append([label, f"{n} / {base}", f"{med[base] / med[n]:.2f}", f"{paired:.2f}"])
        t = r.get("trace")
        if t and "matmul_both_ms" in t:
            d0, d1 = t["stages"][:2]
            trace_rows.append(
                [
                    label,
                    f"{t['span_ms']:.1f}",
                    str(t["threads"]),
                    f"{t['op_busy_ms'][d0]:.1f} / {t['op_busy_ms'][d1]:.1f}",
                    f"{t['op_both_ms']:.1f}",
                    f"{t['matmul_busy_ms'][d0]:.1f} / {t['matmul_busy_ms'][d1]:.1f}",
                    f"{t['mean_matmul_ms'].get(d0, 0):.2f} / {t['mean_matmul_ms'].get(d1, 0):.2f}",
                    f"{t['matmul_both_ms']:.1f}",
                    f"{t['matmul_both_ms'] / max(1e-9, min(t['matmul_busy_ms'].values())):.2f}",
                ]
            )
    harness.print_table(["setting", "variant", "median ms/step", "CPU util (process CPU / wall)"], rows)
    harness.print_table(
        ["setting", "pipeline / baseline", "throughput ratio (ratio of medians)", "median paired ratio"],
        ratio_rows,
        "Pipeline throughput over plain Keras micro-batching (target >= 1.3 for K=2 over plain_mb)",
    )
    if trace_rows:
        harness.print_table(
            [
                "setting",
                "traced step ms",
                "TF threads running ops",
                "op busy ms stage 0 / 1",
                "any op on both at once ms",
                "MatMul busy ms stage 0 / 1",
                "mean MatMul ms",
                "MatMul on both at once ms",
                "overlap fraction",
            ],
            trace_rows,
            "One traced step of pipe_k2_gpipe (tf.profiler; busy = union of op intervals)",
        )
    harness.finish("overlap", runs=runs)


if __name__ == "__main__":
    app.run(main)
