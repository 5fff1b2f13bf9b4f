"""Step time with pipeline stages in separate TensorFlow worker processes vs in one process.

A 2-stage pipeline (K=2, M=4, remat="never", SGD) of Dense layers of width W, batch 256, in
three placements, each in a fresh client process: ``one process`` (``configure_virtual_cpus(2)``),
``1 worker`` (both stages on one ``tf.distribute.Server``: the cost of running remotely) and
``2 workers`` (stage k on worker k: activations and gradients cross processes over gRPC). The
workers start once; each round runs one client per placement, the order rotated. Method,
command and results: benchmarks/cluster/README.md.
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
flags.DEFINE_list("widths", ["64", "256", "1024", "4096"], "Dense widths W (boundary = batch x W).")
flags.DEFINE_integer("batch", 256, "Mini-batch size N.")
flags.DEFINE_integer("micro_batches", 4, "M.")
flags.DEFINE_integer("rounds", 3, "Rounds; each runs one client per placement.")
flags.DEFINE_integer("steps", 10, "Timed steps per width per client.")
flags.DEFINE_integer("warmup", 3, "Untimed steps per width per client (the first traces).")
flags.DEFINE_integer("max_step_seconds", 30, "Fewer steps for a width whose warm-up step is slower.")
flags.DEFINE_string("out", harness.OUT_DIR, "Directory for the JSON.")
flags.DEFINE_string("from_json", "", "Only reprint the table from the JSON of an earlier run.")
flags.DEFINE_bool("child", False, "Internal: time every width in this process, print RESULT lines.")
flags.DEFINE_enum("mode", "local", ["local", "worker1", "workers2"], "Internal (child): placement.")
MODES = {"local": "one process", "worker1": "1 worker", "workers2": "2 workers"}


def child() -> None:
    import tf_gpipe

    if FLAGS.mode == "local":
        devices = tf_gpipe.configure_virtual_cpus(2)
    else:
        from tf_gpipe import cluster

        cluster.connect()  # TF_CONFIG from the parent
        devices = cluster.worker_devices(2)
    import keras
    import numpy as np
    import tensorflow as tf

    for width in map(int, FLAGS.widths):
        keras.utils.set_random_seed(0)
        layers = [keras.layers.InputLayer(shape=(width,))]
        layers += [keras.layers.Dense(width, activation="relu") for _ in range(2)] + [keras.layers.Dense(10)]
        kwargs = dict(balance=[1, 2], devices=devices, num_micro_batches=FLAGS.micro_batches, remat="never")
        model = tf_gpipe.PipelineModel(layers, **kwargs)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        model.compile(optimizer=keras.optimizers.SGD(1e-3), loss=loss)
        rng = np.random.RandomState(0)
        x = tf.constant(rng.randn(FLAGS.batch, width).astype("float32"))
        y = tf.constant(rng.randint(0, 10, FLAGS.batch))

        def timed(model=model, x=x, y=y):
            t = time.perf_counter()
            model.train_on_batch(x, y)
            return time.perf_counter() - t

        trace_s = timed()
        warm = [timed() for _ in range(FLAGS.warmup)]
        slow = min(warm) * FLAGS.steps >= FLAGS.max_step_seconds
        times = [timed() for _ in range(max(3, FLAGS.steps // 3) if slow else FLAGS.steps)]
        placed = sorted({v.value.device for v in model.trainable_variables})
        harness.emit(dict(mode=FLAGS.mode, width=width, step_s=times, trace_s=trace_s, devices=placed))


def table(rows, batch: int) -> None:
    """One row per (width, placement), with ratios to 'one process': of the medians, and the median
    of per-round ratios (round i of every placement ran back to back, which cancels most of the
    drift in the machine's load)."""
    out = []
    for r in rows:
        base = next(b for b in rows if b["mode"] == "local" and b["width"] == r["width"])
        paired = statistics.median(a / b for a, b in zip(r["round_medians_ms"], base["round_medians_ms"]))
        act, logits = batch * r["width"] * 4, batch * 10 * 4
        # client -> stage 0: the input; last stage -> client: logits, and their gradient back; with 2
        # workers also the boundary activation forward and its gradient backward.
        crossing = {"local": 0, "worker1": act + 2 * logits, "workers2": 3 * act + 2 * logits}[r["mode"]]
        med, base_med, rounds = r["median_ms"], base["median_ms"], r["round_medians_ms"]
        row = [r["width"], f"{2 * act / 1e6:.2f}", MODES[r["mode"]], f"{med:.1f}"]
        row += [", ".join(f"{v:.1f}" for v in rounds), f"{med / base_med:.2f}x", f"{paired:.2f}x"]
        out.append(row + [f"{med - base_med:+.1f}", f"{crossing / 1e6:.2f}"])
    headers = "W|boundary MB/step|placement|median step (ms)|per-round medians (ms)|vs one process (medians)"
    headers += "|vs one process (median of per-round ratios)|extra ms/step|MB crossing processes/step"
    harness.print_table(headers, out)


def main(argv) -> None:
    del argv
    if FLAGS.child:
        return child()
    if FLAGS.from_json:
        data = harness.load_json(FLAGS.from_json)
        return table(data["rows"], data["flags"]["batch"])
    from tf_gpipe.cluster import LocalCluster

    harness.header("tf_gpipe cluster benchmark: stages in worker processes vs one process")
    runs: dict = {}
    with LocalCluster(1, devices_per_worker=2) as one, LocalCluster(2) as two:
        configs = {"local": None, "worker1": one.tf_config, "workers2": two.tf_config}
        order = list(configs)
        for r in range(FLAGS.rounds):
            for mode in order[r % 3 :] + order[: r % 3]:
                for res in harness.child(harness.child_env(tf_config=configs[mode]), timeout=1800, mode=mode):
                    runs.setdefault((res["width"], order.index(mode)), []).append(res)
    rows = []
    for (width, i), rounds in sorted(runs.items()):
        steps = [s for run in rounds for s in run["step_s"]]
        rounds_ms = [round(1000 * statistics.median(run["step_s"]), 2) for run in rounds]
        row = dict(mode=order[i], width=width, median_ms=1000 * statistics.median(steps), steps=len(steps))
        rows.append(dict(row, round_medians_ms=rounds_ms, devices=rounds[0]["devices"]))
    table(rows, FLAGS.batch)
    harness.finish("cluster_benchmark", rows=rows)


if __name__ == "__main__":
    app.run(main)
