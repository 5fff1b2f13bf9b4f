"""Measured peak training memory of tf_gpipe.PipelineModel: remat x K x M.

One fresh child process (this script with ``--child``) per configuration; each reports
TensorFlow's CPU allocator peak and the RSS peak above a baseline taken right before
the first step. The parent prints them next to GPipe's memory model and plots them.
Method, command and results: benchmarks/remat_memory/README.md. Never run by the tests.
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
flags.DEFINE_integer("depth", 32, "L: number of hidden Dense(width, relu) layers.")
flags.DEFINE_integer("width", 1024, "Units per hidden layer (and input features).")
flags.DEFINE_integer("batch", 4096, "N: mini-batch size.")
flags.DEFINE_list("stages", ["1", "2", "4"], "Values of K.")
flags.DEFINE_list("micro_batches", ["1", "2", "4", "8"], "Values of M.")
flags.DEFINE_list("remats", ["never", "always"], "remat modes.")
flags.DEFINE_bool("plain", True, "Also measure plain keras.Sequential (row K=-, M=-).")
flags.DEFINE_integer("repeats", 1, "Fresh child processes per configuration (median reported).")
flags.DEFINE_integer(
    "steps",
    2,
    "Training steps per configuration (the first one also traces; the second can peak a few % "
    "higher and gives a step time without tracing).",
)
flags.DEFINE_integer(
    "mmap_threshold",
    1 << 20,
    "MALLOC_MMAP_THRESHOLD_ for the children, bytes (0: leave glibc's dynamic default).",
)
flags.DEFINE_string(
    "schedule", "", "PipelineModel(schedule=...) if the installed tf_gpipe has it ('' = its default)."
)
flags.DEFINE_bool(
    "arithmetic_optimization",
    True,
    "Grappler's arithmetic optimizer in the children (False: "
    "tf.config.optimizer.set_experimental_options({'arithmetic_optimization': False})).",
)
flags.DEFINE_string("out", harness.OUT_DIR, "Directory for the PNG and JSON.")
flags.DEFINE_string("replot", "", "Re-print the table and re-draw the plot from this JSON (no runs).")
# child mode
flags.DEFINE_bool("child", False, "Internal: run one configuration and print a RESULT line.")
flags.DEFINE_integer("k", 1, "Internal (child): K; 0 means plain keras.Sequential.")
flags.DEFINE_integer("m", 1, "Internal (child): M.")
flags.DEFINE_string("remat", "never", "Internal (child): remat mode.")

MiB = harness.MiB


def child() -> None:
    import gc
    import resource

    import tf_gpipe

    K = FLAGS.k
    if K > 0:
        tf_gpipe.configure_virtual_cpus(K)  # before any TF op
    import keras
    import numpy as np
    import tensorflow as tf

    tf.get_logger().setLevel("ERROR")
    if not FLAGS.arithmetic_optimization:
        tf.config.optimizer.set_experimental_options({"arithmetic_optimization": False})
    keras.utils.set_random_seed(0)
    layers = (
        [keras.layers.InputLayer(shape=(FLAGS.width,))]
        + [keras.layers.Dense(FLAGS.width, activation="relu") for _ in range(FLAGS.depth)]
        + [keras.layers.Dense(10)]
    )
    if K > 0:
        extra = {"schedule": FLAGS.schedule} if FLAGS.schedule else {}
        model = tf_gpipe.PipelineModel(
            layers, num_stages=K, num_micro_batches=FLAGS.m, remat=FLAGS.remat, **extra
        )
    else:
        model = keras.Sequential(layers)
    model.compile(
        optimizer=keras.optimizers.SGD(1e-4),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=False,
    )
    rng = np.random.default_rng(0)
    with tf.device("CPU:0"):
        x = tf.constant(rng.standard_normal((FLAGS.batch, FLAGS.width), dtype=np.float32))
        y = tf.constant(rng.integers(0, 10, FLAGS.batch), dtype=tf.int32)
    weights_mib = sum(int(np.prod(v.shape)) * 4 for v in model.weights) / MiB

    gc.collect()
    tf_base = tf.config.experimental.get_memory_info("CPU:0")["current"]
    tf.config.experimental.reset_memory_stats("CPU:0")
    rss_base = harness.vm("VmRSS")

    step_times, tf_peaks, losses = [], [], []
    for _ in range(FLAGS.steps):
        t0 = time.perf_counter()
        losses.append(float(model.train_on_batch(x, y)))
        step_times.append(time.perf_counter() - t0)
        tf_peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"])
    ru_maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    result = dict(
        K=K,
        M=FLAGS.m,
        remat=FLAGS.remat if K > 0 else "-",
        tf_peak_MiB=(max(tf_peaks) - tf_base) / MiB,
        tf_peak_step1_MiB=(tf_peaks[0] - tf_base) / MiB,
        rss_peak_MiB=(ru_maxrss - rss_base) / MiB,
        rss_base_MiB=rss_base / MiB,
        tf_base_MiB=tf_base / MiB,
        weights_MiB=weights_mib,
        step_s=step_times[-1] if len(step_times) > 1 else float("nan"),
        first_step_s=step_times[0],
        losses=losses,
        devices=list(getattr(model, "devices", ["(plain)"])),
    )
    harness.emit(result)


def paper_model(K: int, M: int, remat: str, L: int):
    """GPipe's activation memory in units of N*L (= the K=1, M=1, never row).

    Returns ``(per_device, whole_process)``: per device (N + (L/K)(N/M)) with
    re-materialization, O(N*L) = 1 without. The whole process holds all K logical
    devices: each keeps its stage input for all M micro-batches (K*N) and up to
    min(K, M) stages re-materialize one micro-batch at the same time, so
    (K*N + min(K, M)*(L/K)*(N/M)); with remat="never", N*L as for one device.
    """
    if remat == "never" or K <= 0:
        return 1.0, 1.0
    per_device = 1.0 / L + 1.0 / (K * M)  # (N + (L/K)(N/M)) / (N L)
    whole = K / L + min(K, M) / (K * M)  # (K N + min(K,M) (L/K)(N/M)) / (N L)
    return per_device, whole


def report(results, meta, out_dir, load_end, wall_s=None) -> None:
    """Print the Markdown table, write JSON and PNG (also used by --replot)."""
    L, N, W = meta["depth"], meta["batch"], meta["width"]
    steps = meta.get("steps") or (
        1 if all(r.get("step_s") != r.get("step_s") for r in results if "error" not in r) else 2
    )
    repeats = (
        meta.get("repeats") or max((len(r.get("tf_peak_MiB_runs", [])) for r in results), default=1) or 1
    )
    ok = [r for r in results if "error" not in r]
    ref = next((r for r in ok if r["K"] == 1 and r["M"] == 1 and r["remat"] == "never"), None)

    def rng(r, key):
        runs = r.get(key + "_runs", [])
        return f" ({min(runs):.0f}-{max(runs):.0f})" if len(runs) > 1 else ""

    def model_mib(r):
        if ref is None:
            return "n/a"
        _, whole = paper_model(r["K"], r["M"], r["remat"], L)
        if r["remat"] in ("never", "-"):
            return f"{ref['tf_peak_MiB']:.0f}"
        return f"{whole * ref['tf_peak_MiB'] + r['weights_MiB']:.0f}"

    rows = []
    for r in ok:
        per_dev, total = paper_model(r["K"], r["M"], r["remat"], L)
        rows.append(
            [
                "plain" if r["K"] == 0 else r["K"],
                "-" if r["K"] == 0 else r["M"],
                r["remat"],
                f"{r['tf_peak_MiB']:.0f}" + rng(r, "tf_peak_MiB"),
                f"{r['rss_peak_MiB']:.0f}" + rng(r, "rss_peak_MiB"),
                f"{r['tf_peak_MiB'] / ref['tf_peak_MiB']:.3f}" if ref and ref["tf_peak_MiB"] > 0 else "n/a",
                f"{r['rss_peak_MiB'] / ref['rss_peak_MiB']:.3f}"
                if ref and ref["rss_peak_MiB"] > 0
                else "n/a",
                f"{per_dev:.3f}",
                f"{total:.3f}",
                model_mib(r),
                f"{r['step_s']:.2f}" if r["step_s"] == r["step_s"] else f"{r['first_step_s']:.2f}",
            ]
        )
    print()
    print(
        harness.md_table(
            [
                "K",
                "M",
                "remat",
                "peak_MiB (TF alloc)",
                "peak_MiB (RSS)",
                "TF alloc / ref",
                "RSS / ref",
                "paper per device",
                "paper whole process",
                "model MiB",
                "step s" if steps > 1 else "1st step s (incl. trace)",
            ],
            rows,
        )
    )
    if repeats > 1:
        print(f"\npeak columns: median over {repeats} fresh processes (min-max).")
    print(
        "\nref = the K=1, M=1, remat=never row (N*L activations). paper per device = "
        "(N + (L/K)(N/M)) / (N L) with remat, 1 without; paper whole process = "
        "(K N + min(K,M) (L/K)(N/M)) / (N L) with remat (all K logical devices live in this one "
        "process), 1 without. model MiB = whole process x ref + one copy of the weight gradients "
        f"(the running sums, {ok[0]['weights_MiB'] if ok else float('nan'):.0f} MiB) for remat rows "
        "(an over-estimate at K=M=1, where the replay is the plain backward), ref for the others."
    )
    print(f"\n- loadavg at end: {load_end}" + (f"; total wall {wall_s:.0f} s" if wall_s else ""))

    harness.save_json(
        os.path.join(out_dir, "remat_memory.json"), dict(meta, load_end=load_end, results=results)
    )
    plt = harness.pyplot()
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"]
    ks = sorted({r["K"] for r in ok if r["K"] > 0})
    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    for ax, key, title in (
        (axes[0], "tf_peak_MiB", "TF CPU allocator peak - baseline"),
        (axes[1], "rss_peak_MiB", "peak RSS (ru_maxrss) - baseline RSS"),
    ):
        for remat, style in (("never", "--"), ("always", "-"), ("except_last", "-.")):
            for K, color in zip(ks, colors):
                pts = sorted((r["M"], r[key]) for r in ok if r["K"] == K and r["remat"] == remat)
                if pts:
                    ax.plot(
                        [p[0] for p in pts],
                        [p[1] for p in pts],
                        style,
                        marker="o",
                        color=color,
                        label=f"K={K} remat={remat}",
                    )
        if ref and key == "tf_peak_MiB":
            for K, color in zip(ks, colors):
                ms = sorted({r["M"] for r in ok if r["K"] == K and r["remat"] == "always"})
                if ms:
                    w = next(r["weights_MiB"] for r in ok)
                    ax.plot(
                        ms,
                        [paper_model(K, m, "always", L)[1] * ref[key] + w for m in ms],
                        ":",
                        color=color,
                        lw=1.2,
                        label=f"K={K} always: model MiB",
                    )
        plain = next((r for r in ok if r["K"] == 0), None)
        if plain:
            ax.axhline(plain[key], color="gray", lw=0.8, label="plain Keras")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["M"] for r in ok}))
        ax.set_xticklabels([str(m) for m in sorted({r["M"] for r in ok})])
        ax.set_xlabel("M (micro-batches)")
        ax.set_ylabel("MiB above the baseline")
        ax.set_ylim(bottom=0)
        ax.set_title(title, fontsize=10)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.suptitle(f"{L} x Dense({W}) + Dense(10), batch {N}: peak training memory vs M")
    fig.tight_layout(rect=(0, 0, 0.84, 1))
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(0.845, 0.5), fontsize=8)
    harness.save_figure(fig, os.path.join(out_dir, "remat_memory.png"), dpi=110)


def replot(path: str) -> None:
    with open(path) as f:
        data = json.load(f)
    results = data.pop("results")
    load_end = data.pop("load_end", "n/a")
    print(f"# re-plotted from {path}")
    for key in ("tf_gpipe", "load_start"):
        if key in data:
            print(f"- {key}: {data[key]}")
    report(results, data, FLAGS.out, load_end)


def parent() -> None:
    load_start = harness.header(
        "tf_gpipe re-materialization memory benchmark", __name__, skip=("child", "k", "m", "remat", "replot")
    )
    L, N, W = FLAGS.depth, FLAGS.batch, FLAGS.width
    print(
        f"- model: {L} x Dense({W}, relu) + Dense(10); batch N={N}; one activation "
        f"tensor N x {W} float32 = {N * W * 4 / MiB:.1f} MiB; weights "
        f"{(L * (W * W + W) + W * 10 + 10) * 4 / MiB:.0f} MiB\n",
        flush=True,
    )

    configs = []
    if FLAGS.plain:
        configs.append((0, 1, "-"))
    for remat in FLAGS.remats:
        for K in map(int, FLAGS.stages):
            for M in map(int, FLAGS.micro_batches):
                configs.append((K, M, remat))

    env = harness.child_env(FLAGS.mmap_threshold)
    results = []
    t_all = time.perf_counter()
    for K, M, remat in configs:
        args = [
            "--child",
            f"--k={K}",
            f"--m={M}",
            f"--remat={remat if K > 0 else 'never'}",
            *harness.flag_args(("depth", "width", "batch", "steps", "schedule", "arithmetic_optimization")),
        ]
        runs = []
        for _ in range(FLAGS.repeats):
            t0 = time.perf_counter()
            proc, lines = harness.run_child(__file__, args, env)
            if proc.returncode != 0 or not lines:
                print(f"K={K} M={M} remat={remat}: child failed (rc={proc.returncode})")
                print(proc.stderr[-3000:])
                runs = [{"K": K, "M": M, "remat": remat, "error": proc.stderr[-3000:]}]
                break
            run = lines[0]
            run["wall_s"] = time.perf_counter() - t0
            runs.append(run)
            label = "plain Keras" if K == 0 else f"K={K} M={M} remat={remat}"
            print(
                f"{label:28s} tf_peak={run['tf_peak_MiB']:8.1f} MiB  "
                f"rss_peak={run['rss_peak_MiB']:8.1f} MiB  "
                f"1st step={run['first_step_s']:.2f}s  step={run['step_s']:.2f}s  "
                f"wall={run['wall_s']:.0f}s  loss={run['losses'][0]:.5f}",
                flush=True,
            )
        r = dict(runs[0])
        if "error" not in r:
            for key in ("tf_peak_MiB", "rss_peak_MiB", "step_s"):
                r[key + "_runs"] = [x[key] for x in runs]
                r[key] = statistics.median(r[key + "_runs"])
        results.append(r)

    meta = dict(
        env=harness.env_lines(),
        tf_gpipe=harness.tf_gpipe_line(),
        load_start=load_start,
        depth=L,
        width=W,
        batch=N,
        steps=FLAGS.steps,
        repeats=FLAGS.repeats,
        arithmetic_optimization=FLAGS.arithmetic_optimization,
        schedule=FLAGS.schedule,
    )
    report(results, meta, FLAGS.out, harness.loadavg(), time.perf_counter() - t_all)


def main(argv):
    del argv
    if FLAGS.child:
        child()
    elif FLAGS.replot:
        replot(FLAGS.replot)
    else:
        parent()


if __name__ == "__main__":
    app.run(main)
