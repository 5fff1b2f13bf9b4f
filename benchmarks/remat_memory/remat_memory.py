"""Measured peak training memory of tf_gpipe.PipelineModel: remat x K x M.

One fresh child process per configuration; each reports TensorFlow's CPU allocator peak and
the RSS peak above a baseline taken right before the first step. The parent prints them next
to GPipe's memory model. Method, command and results: benchmarks/remat_memory/README.md.
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
flags.DEFINE_integer("depth", 32, "L: number of hidden Dense(width, relu) layers.")
flags.DEFINE_integer("width", 1024, "Units per hidden layer (and input features).")
flags.DEFINE_integer("batch", 4096, "N: mini-batch size.")
flags.DEFINE_list("stages", ["1", "2", "4"], "Values of K.")
flags.DEFINE_list("micro_batches", ["1", "2", "4", "8"], "Values of M.")
flags.DEFINE_list("remats", ["never", "always"], "remat modes.")
flags.DEFINE_bool("plain", True, "Also measure plain keras.Sequential (row K=plain).")
flags.DEFINE_integer("repeats", 1, "Fresh child processes per configuration (median reported).")
flags.DEFINE_integer("steps", 2, "Training steps per configuration (the first one also traces).")
flags.DEFINE_integer("mmap_threshold", 1 << 20, "MALLOC_MMAP_THRESHOLD_ of the children (0: glibc's).")
flags.DEFINE_bool("arithmetic_optimization", True, "Grappler's arithmetic optimizer in the children.")
flags.DEFINE_string("out", harness.OUT_DIR, "Directory for the JSON.")
flags.DEFINE_string("replot", "", "Re-print the table from this JSON (no runs).")
flags.DEFINE_bool("child", False, "Internal: measure the one configuration given (K=0: plain Keras).")
MiB = harness.MiB


def child() -> None:
    import gc
    import resource

    import tf_gpipe

    K, M, remat = int(FLAGS.stages[0]), int(FLAGS.micro_batches[0]), FLAGS.remats[0]
    if K > 0:
        tf_gpipe.configure_virtual_cpus(K)  # before any TF op
    import numpy as np
    import tensorflow as tf

    tf.get_logger().setLevel("ERROR")
    if not FLAGS.arithmetic_optimization:
        tf.config.optimizer.set_experimental_options({"arithmetic_optimization": False})
    model, x, y = harness.dense_stack(K, M, remat, FLAGS.depth, FLAGS.width, FLAGS.batch)

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
    harness.emit(
        dict(
            K=K,
            M=M,
            remat=remat if K > 0 else "-",
            tf_peak_MiB=(max(tf_peaks) - tf_base) / MiB,
            rss_peak_MiB=(ru_maxrss - rss_base) / MiB,
            weights_MiB=sum(int(np.prod(v.shape)) * 4 for v in model.weights) / MiB,
            step_s=step_times[-1] if len(step_times) > 1 else float("nan"),
            first_step_s=step_times[0],
            losses=losses,
        )
    )


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
    return 1.0 / L + 1.0 / (K * M), K / L + min(K, M) / (K * M)


def report(results, L: int, steps: int) -> None:
    ok = [r for r in results if "error" not in r]
    ref = next((r for r in ok if (r["K"], r["M"], r["remat"]) == (1, 1, "never")), None)

    def ratio(r, key):
        return f"{r[key] / ref[key]:.3f}" if ref and ref[key] > 0 else "n/a"

    def spread(r, key):
        runs = r.get(key + "_runs", [])
        return f" ({min(runs):.0f}-{max(runs):.0f})" if len(runs) > 1 else ""

    rows = []
    for r in ok:
        per_dev, whole = paper_model(r["K"], r["M"], r["remat"], L)
        model = "n/a" if ref is None else f"{ref['tf_peak_MiB']:.0f}"
        if ref and r["remat"] not in ("never", "-"):
            model = f"{whole * ref['tf_peak_MiB'] + r['weights_MiB']:.0f}"
        step = r["step_s"] if r["step_s"] == r["step_s"] else r["first_step_s"]
        peaks = [f"{r[k]:.0f}" + spread(r, k) for k in ("tf_peak_MiB", "rss_peak_MiB")]
        rows.append([
            "plain" if r["K"] == 0 else r["K"], "-" if r["K"] == 0 else r["M"], r["remat"], *peaks,
            ratio(r, "tf_peak_MiB"), ratio(r, "rss_peak_MiB"), f"{per_dev:.3f}", f"{whole:.3f}", model,
            f"{step:.2f}",
        ])  # fmt: skip
    headers = ["K", "M", "remat", "peak_MiB (TF alloc)", "peak_MiB (RSS)", "TF alloc / ref", "RSS / ref"]
    headers += ["paper per device", "paper whole process", "model MiB"]
    harness.print_table([*headers, "step s" if steps > 1 else "1st step s (incl. trace)"], rows)
    repeats = max((len(r.get("tf_peak_MiB_runs", [])) for r in ok), default=1)
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


def main(argv):
    del argv
    if FLAGS.child:
        return child()
    if FLAGS.replot:
        data = harness.load_json(FLAGS.replot)
        return report(data["results"], data["flags"]["depth"], data["flags"]["steps"])
    L, N, W = FLAGS.depth, FLAGS.batch, FLAGS.width
    weights = (L * (W * W + W) + W * 10 + 10) * 4 / MiB
    harness.header(
        "tf_gpipe re-materialization memory benchmark",
        extra=[f"model: {L} x Dense({W}, relu) + Dense(10); batch N={N}; one activation tensor "
               f"N x {W} float32 = {N * W * 4 / MiB:.1f} MiB; weights {weights:.0f} MiB"],
    )  # fmt: skip
    configs = [(0, 1, "never")] if FLAGS.plain else []
    configs += [(int(K), int(M), r) for r in FLAGS.remats for K in FLAGS.stages for M in FLAGS.micro_batches]
    env = harness.child_env(FLAGS.mmap_threshold)
    results = []
    for K, M, remat in configs:
        runs = []
        for _ in range(FLAGS.repeats):
            run = harness.child(env, stages=[K], micro_batches=[M], remats=[remat])
            if not run:
                break
            runs += run
        r = dict(runs[0]) if len(runs) == FLAGS.repeats else dict(K=K, M=M, remat=remat, error=True)
        for key in ("tf_peak_MiB", "rss_peak_MiB", "step_s") if "error" not in r else ():
            r[key + "_runs"] = [x[key] for x in runs]
            r[key] = statistics.median(r[key + "_runs"])
        results.append(r)
    report(results, L, FLAGS.steps)
    harness.finish("remat_memory", results=results)


if __name__ == "__main__":
    app.run(main)
