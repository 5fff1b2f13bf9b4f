"""Step time with pipeline stages in separate TensorFlow worker processes vs in one process.

A 2-stage pipeline (K=2, M=4, remat="never", SGD) of Dense layers of width W, batch 256, in
three placements, each in a fresh client process (this script with ``--child``): ``one
process`` (``configure_virtual_cpus(2)``), ``1 worker`` (both stages on one
``tf.distribute.Server``: the cost of running remotely) and ``2 workers`` (stage k on worker k:
activations and gradients cross processes over gRPC). The workers start once; each round runs
one client per placement, the order rotated. Method, command and results:
benchmarks/cluster/README.md. Writes --out/cluster_benchmark.{png,json}. Never run by the tests.
"""

from __future__ import annotations

import json
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
flags.DEFINE_string("out", harness.OUT_DIR, "Directory for the PNG and JSON.")
flags.DEFINE_string("from_json", "", "Only redraw the table and plot from the JSON of an earlier run.")
flags.DEFINE_bool("child", False, "Internal: time every width in this process, print RESULT lines.")
flags.DEFINE_enum("mode", "local", ["local", "worker1", "workers2"], "Internal (child): placement.")

MODES = {"local": "one process", "worker1": "1 worker", "workers2": "2 workers"}
COLORS = {"local": "tab:blue", "worker1": "tab:orange", "workers2": "tab:green"}


def child() -> None:
    import tf_gpipe

    if FLAGS.mode == "local":
        tf_gpipe.configure_virtual_cpus(2)
        devices = ["/device:CPU:0", "/device:CPU:1"]
    else:
        from tf_gpipe import cluster

        cluster.connect()  # TF_CONFIG from the parent
        devices = cluster.worker_devices(2)
    import keras
    import numpy as np
    import tensorflow as tf

    for width in map(int, FLAGS.widths):
        keras.utils.set_random_seed(0)
        layers = [
            keras.layers.InputLayer(shape=(width,)),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(10),
        ]
        model = tf_gpipe.PipelineModel(
            layers, balance=[1, 2], devices=devices, num_micro_batches=FLAGS.micro_batches, remat="never"
        )
        model.compile(
            optimizer=keras.optimizers.SGD(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        rng = np.random.RandomState(0)
        x = tf.constant(rng.randn(FLAGS.batch, width).astype("float32"))
        y = tf.constant(rng.randint(0, 10, FLAGS.batch))
        start = time.perf_counter()
        model.train_on_batch(x, y)  # traces
        trace_s = time.perf_counter() - start
        warm = []
        for _ in range(FLAGS.warmup):
            t = time.perf_counter()
            model.train_on_batch(x, y)
            warm.append(time.perf_counter() - t)
        steps = FLAGS.steps if min(warm) * FLAGS.steps < FLAGS.max_step_seconds else max(3, FLAGS.steps // 3)
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            loss = model.train_on_batch(x, y)
            times.append(time.perf_counter() - t)
        placed = sorted({v.value.device for v in model.trainable_variables})
        result = dict(mode=FLAGS.mode, width=width, step_s=times, trace_s=trace_s, loss=float(loss))
        harness.emit(dict(result, devices=placed))


def run_child(mode: str, tf_config: str | None) -> list:
    args = ["--child", f"--mode={mode}"]
    args += harness.flag_args(("widths", "batch", "micro_batches", "steps", "warmup", "max_step_seconds"))
    proc, results = harness.run_child(__file__, args, harness.child_env(tf_config=tf_config), timeout=1800)
    if proc.returncode:
        raise RuntimeError(f"child {mode} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return results


def crossing_mb(mode: str, width: int) -> float:
    """MB that cross a process boundary per step (float32), by placement."""
    act = FLAGS.batch * width * 4
    logits = FLAGS.batch * 10 * 4
    if mode == "local":
        return 0.0
    # client -> stage 0: the input; last stage -> client: logits, and their gradient back.
    crossing = act + 2 * logits
    if mode == "workers2":
        crossing += 2 * act  # boundary activation forward, its gradient backward
    return crossing / 1e6


def plot(rows: list, path: str) -> None:
    plt = harness.pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    widths = sorted({r["width"] for r in rows})
    for mode, label in MODES.items():
        med = [next(r["median_ms"] for r in rows if r["mode"] == mode and r["width"] == w) for w in widths]
        ax1.plot(widths, med, marker="o", label=label, color=COLORS[mode])
        if mode != "local":
            by_width = {r["width"]: r["paired_ratio"] for r in rows if r["mode"] == mode}
            ratio = [by_width[w] for w in widths]
            ax2.plot(widths, ratio, marker="o", label=label, color=COLORS[mode])
    ax1.set(
        xscale="log",
        yscale="log",
        xlabel="Dense width W (boundary = 256 x W floats)",
        ylabel="median step time (ms)",
        title="Step time, K=2 M=4, batch 256",
    )
    ax2.axhline(1.0, color="grey", lw=0.8)
    ax2.set(
        xscale="log",
        xlabel="Dense width W",
        ylabel="step time / one process, same round",
        title="Overhead of worker processes (loopback)",
    )
    for ax in (ax1, ax2):
        ax.set_xticks(widths, [str(w) for w in widths])
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    harness.save_figure(fig, path, dpi=110)


def summarize(results: dict) -> list:
    """One row per (width, placement): medians, and ratios to 'one process'."""

    def key(item):
        (mode, width), _ = item
        return width, list(MODES).index(mode)

    rows = []
    for (mode, width), runs in sorted(results.items(), key=key):
        steps = [s for run in runs for s in run["step_s"]]
        rows.append(
            {
                "mode": mode,
                "width": width,
                "median_ms": 1000 * statistics.median(steps),
                "round_medians_ms": [round(1000 * statistics.median(run["step_s"]), 2) for run in runs],
                "steps": len(steps),
                "devices": runs[0]["devices"],
                "crossing_mb": crossing_mb(mode, width),
            }
        )
    return rows


def add_ratios(rows: list) -> None:
    # Round i of every placement ran back to back, so the per-round ratio cancels most of
    # the drift in the machine's load; its median is the number to read.
    for row in rows:
        base = next(r for r in rows if r["mode"] == "local" and r["width"] == row["width"])
        row["ratio"] = row["median_ms"] / base["median_ms"]
        row["extra_ms"] = row["median_ms"] - base["median_ms"]
        pairs = zip(row["round_medians_ms"], base["round_medians_ms"])
        row["paired_ratio"] = statistics.median(a / b for a, b in pairs)


def render(report: dict) -> str:
    rows = report["rows"]
    add_ratios(rows)
    batch = report.get("batch", FLAGS.batch)
    plot(rows, os.path.join(FLAGS.out, "cluster_benchmark.png"))
    return harness.md_table(
        [
            "W",
            "boundary MB/step",
            "placement",
            "median step (ms)",
            "per-round medians (ms)",
            "vs one process (medians)",
            "vs one process (median of per-round ratios)",
            "extra ms/step",
            "MB crossing processes/step",
        ],
        [
            [
                r["width"],
                f"{2 * batch * r['width'] * 4 / 1e6:.2f}",
                MODES[r["mode"]],
                f"{r['median_ms']:.1f}",
                ", ".join(f"{v:.1f}" for v in r["round_medians_ms"]),
                f"{r['ratio']:.2f}x",
                f"{r['paired_ratio']:.2f}x",
                f"{r['extra_ms']:+.1f}",
                f"{r['crossing_mb']:.2f}",
            ]
            for r in rows
        ],
    )


def main(argv) -> None:
    del argv
    if FLAGS.child:
        child()
        return
    os.makedirs(FLAGS.out, exist_ok=True)
    if FLAGS.from_json:
        with open(FLAGS.from_json) as f:
            report = json.load(f)
        print(render(report))
        print(
            f"\ncommand: {report['command']}\nloadavg start: {report['loadavg_start']}; "
            f"end: {report['loadavg_end']}"
        )
        print("\n".join(report["env"]))
        return
    from tf_gpipe.cluster import LocalCluster

    load_start = harness.loadavg()
    results: dict = {}
    with LocalCluster(1, devices_per_worker=2) as one, LocalCluster(2) as two:
        configs = {"local": None, "worker1": one.tf_config, "workers2": two.tf_config}
        order = list(configs)
        for r in range(FLAGS.rounds):
            for mode in order[r % 3 :] + order[: r % 3]:
                t = time.time()
                for res in run_child(mode, configs[mode]):
                    results.setdefault((mode, res["width"]), []).append(res)
                print(f"round {r + 1}/{FLAGS.rounds} {MODES[mode]}: {time.time() - t:.0f} s", file=sys.stderr)
    command = "python3 " + " ".join([os.path.relpath(__file__, harness.REPO_ROOT), *sys.argv[1:]])
    report = {
        "command": command,
        "env": harness.env_lines() + [harness.tf_gpipe_line()],
        "batch": FLAGS.batch,
        "loadavg_start": load_start,
        "loadavg_end": harness.loadavg(),
        "rows": summarize(results),
    }
    table = render(report)
    harness.save_json(os.path.join(FLAGS.out, "cluster_benchmark.json"), report)
    print(table)
    print(f"\ncommand: {command}\nloadavg start: {load_start}; end: {report['loadavg_end']}")
    print("\n".join(report["env"]))


if __name__ == "__main__":
    app.run(main)
