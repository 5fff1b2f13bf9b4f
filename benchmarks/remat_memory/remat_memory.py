"""Measured peak training memory of tf_gpipe.PipelineModel: remat x K x M.

Each configuration (K stages, M micro-batches, remat mode) runs in a fresh
subprocess (this script with ``--child``). The child calls
``tf_gpipe.configure_virtual_cpus(K)`` first, builds a deep MLP
(``--depth`` x Dense(``--width``, relu) + Dense(10) head, so L = depth), compiles
it with plain SGD (no optimizer slots) and sparse categorical cross-entropy, and
creates one in-memory batch of ``--batch`` examples. Then, right before the first
training step, it takes a baseline, and runs ``--steps`` ``train_on_batch`` steps
(default 2: the second step sometimes peaks a few percent above the first, and its
time has no tracing in it; ``--repeats=R`` runs every configuration in R fresh
processes and reports the median).

Two measurements per configuration, both minus the baseline:

* ``tf_peak_MiB``: TensorFlow's CPU allocator high-water mark,
  ``tf.config.experimental.get_memory_info("CPU:0")["peak"]`` (reset with
  ``reset_memory_stats`` at the baseline) minus the allocator's ``current`` bytes
  at the baseline. In TF 2.21 this works on CPU; all logical CPUs share one
  allocator, so it is the total over all K stages. It counts every tensor TF
  allocates (activations, gradients, temporaries), not Python objects, the traced
  graph, or memory oneDNN allocates by itself.
* ``rss_peak_MiB``: ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` after the steps
  minus VmRSS at the baseline. Includes everything the process touches during
  the first step, the tf.function trace of the (bigger for large K*M) training
  graph included. The child sets ``MALLOC_MMAP_THRESHOLD_`` (``--mmap_threshold``)
  so glibc returns freed large blocks to the OS and RSS follows live memory.

The parent prints a Markdown table with both, normalised to the (K=1, M=1,
remat=never) row, next to GPipe's activation-memory model: O(N*L) without
re-materialization, O(N + (L/K)*(N/M)) per device with it (N = batch, L = layers).
Because all K "devices" here are one process, it also shows the model for the
whole process: O(K*N + min(K, M)*(L/K)*(N/M)) (every stage keeps its input for all
M micro-batches; up to min(K, M) stages re-materialize at once), and that model in
MiB plus one copy of the weight gradients. It plots peak memory against M for
each (K, remat). ``--replot=out.json`` redraws table and plot from a saved run.

Knobs for diagnosis: ``--arithmetic_optimization=false`` turns off Grappler's
arithmetic optimizer in the children (it merges the per-micro-batch gradient sums
into one AddN, see benchmarks/README.md); ``--schedule`` passes ``schedule=`` to
PipelineModel where the installed tf_gpipe has it.

Run (about 6-9 minutes on 2 cores with the defaults, more on a busy machine):

    cd /work/main && PYTHONPATH=. python3 benchmarks/remat_memory.py

Writes benchmarks/out/remat_memory.png and .json. Never run by the tests.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common
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
flags.DEFINE_string("out", _common.OUT_DIR, "Directory for the PNG and JSON.")
flags.DEFINE_string("replot", "", "Re-print the table and re-draw the plot from this JSON (no runs).")
# child mode
flags.DEFINE_bool("child", False, "Internal: run one configuration and print a RESULT line.")
flags.DEFINE_integer("k", 1, "Internal (child): K; 0 means plain keras.Sequential.")
flags.DEFINE_integer("m", 1, "Internal (child): M.")
flags.DEFINE_string("remat", "never", "Internal (child): remat mode.")

MiB = 2.0**20


def _vm(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


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
    rss_base = _vm("VmRSS")

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
    print("RESULT " + json.dumps(result), flush=True)


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
        _common.md_table(
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

    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, "remat_memory.json")
    with open(json_path, "w") as f:
        json.dump(dict(meta, load_end=load_end, results=results), f, indent=1)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    path = os.path.join(out_dir, "remat_memory.png")
    fig.savefig(path, dpi=110)
    print(f"- wrote {path} and {json_path}")


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
    load_start = _common.loadavg()
    print("# tf_gpipe re-materialization memory benchmark\n")
    for line in _common.env_lines():
        print(f"- {line}")
    print(f"- {_common.tf_gpipe_line()}")
    print(f"- loadavg at start: {load_start}")
    ours = [
        f.name
        for f in FLAGS.get_key_flags_for_module(sys.modules[__name__])
        if f.name not in ("child", "k", "m", "remat", "replot")
    ]
    print("- flags: " + " ".join(f"--{k}={FLAGS[k].value}" for k in ours))
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

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), _common.REPO_ROOT) if p)
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    if FLAGS.mmap_threshold > 0:
        env["MALLOC_MMAP_THRESHOLD_"] = str(FLAGS.mmap_threshold)
    results = []
    t_all = time.perf_counter()
    for K, M, remat in configs:
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--child",
            f"--k={K}",
            f"--m={M}",
            f"--remat={remat if K > 0 else 'never'}",
            f"--depth={L}",
            f"--width={W}",
            f"--batch={N}",
            f"--steps={FLAGS.steps}",
            f"--schedule={FLAGS.schedule}",
            f"--arithmetic_optimization={FLAGS.arithmetic_optimization}",
        ]
        runs = []
        for _ in range(FLAGS.repeats):
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
            line = next((s for s in proc.stdout.splitlines() if s.startswith("RESULT ")), None)
            if proc.returncode != 0 or line is None:
                print(f"K={K} M={M} remat={remat}: child failed (rc={proc.returncode})")
                print(proc.stderr[-3000:])
                runs = [{"K": K, "M": M, "remat": remat, "error": proc.stderr[-3000:]}]
                break
            run = json.loads(line[len("RESULT ") :])
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
        env=_common.env_lines(),
        tf_gpipe=_common.tf_gpipe_line(),
        load_start=load_start,
        depth=L,
        width=W,
        batch=N,
        steps=FLAGS.steps,
        repeats=FLAGS.repeats,
        arithmetic_optimization=FLAGS.arithmetic_optimization,
        schedule=FLAGS.schedule,
    )
    report(results, meta, FLAGS.out, _common.loadavg(), time.perf_counter() - t_all)


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
