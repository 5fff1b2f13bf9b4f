"""Step-time overhead of tf_gpipe.PipelineModel with one stage versus plain Keras.

On identical layers and initial weights, Adam and the same loss, interleaved in one process
(``--rounds`` rounds of ``--steps`` ``train_on_batch`` steps per variant, the order rotating):
``PipelineModel(K=1, M=1, remat="never")`` against ``keras.Sequential`` with
``jit_compile`` False, Keras' default and True, and ``PipelineModel(K=1, M=4)`` against a
hand-written micro-batching ``train_step``. Reports median wall time, IQR, paired ratios and
process-CPU-time ratios. Method and results: benchmarks/overhead/README.md.
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
    "configs",
    ["mlp8x1024_b256", "mlp4x256_b64"],
    "'mlp<depth>x<width>_b<batch>': depth Dense(width, relu) on a width-wide input, then Dense(10).",
)
flags.DEFINE_integer("rounds", 60, "Interleaved rounds per config.")
flags.DEFINE_integer("steps", 0, "Steps per variant per round (0: auto, ~0.5 s worth).")
flags.DEFINE_integer("warmup", 5, "Warm-up steps per variant (after the first, tracing, step).")
flags.DEFINE_integer("micro_batches", 4, "M for the micro-batched rows.")
flags.DEFINE_bool("remat_rows", False, "Also time PipelineModel(K=1) with remat='always' (M=1 and M=M).")
flags.DEFINE_string("out", harness.OUT_DIR, "Directory for the JSON.")


def main(argv):
    del argv
    import keras
    import numpy as np
    import tensorflow as tf

    import tf_gpipe

    tf.get_logger().setLevel("ERROR")  # one retracing warning per model is expected here
    harness.header("tf_gpipe overhead benchmark")
    M = FLAGS.micro_batches

    def compiled(model, jit=False):
        kwargs = {} if jit == "default" else {"jit_compile": jit}
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        model.compile(optimizer=keras.optimizers.Adam(1e-4), loss=loss, **kwargs)
        return model

    results, summary = {}, []
    for cfg_name in FLAGS.configs:
        body, batch = cfg_name.split("_b")
        depth, width = map(int, body[len("mlp") :].split("x"))
        batch = int(batch)

        def layers(depth=depth, width=width):
            return (
                [keras.layers.InputLayer(shape=(width,))]
                + [keras.layers.Dense(width, activation="relu") for _ in range(depth)]
                + [keras.layers.Dense(10)]
            )

        def pipe(m, remat="never"):
            return compiled(tf_gpipe.PipelineModel(layers(), num_stages=1, num_micro_batches=m, remat=remat))

        keras.utils.set_random_seed(0)
        rng = np.random.default_rng(0)
        x = tf.constant(rng.standard_normal((batch, width), dtype=np.float32))
        y = tf.constant(rng.integers(0, 10, batch), dtype=tf.int32)
        ref = keras.Sequential(layers())
        variants = {"pipe K=1 M=1": pipe(1)}
        for jit in (False, "default", True):
            variants[f"plain jit={jit}"] = compiled(keras.Sequential(layers()), jit)
        variants[f"plain mb M={M}"] = compiled(harness.micro_batched_sequential(layers(), M))
        variants[f"pipe K=1 M={M}"] = pipe(M)
        if FLAGS.remat_rows:
            variants["pipe K=1 M=1 remat"] = pipe(1, "always")
            variants[f"pipe K=1 M={M} remat"] = pipe(M, "always")

        # identical initial weights; check forward equality and the first-step loss
        ref_out = ref(x[:8]).numpy()
        for name, model in variants.items():
            if not model.built:
                model(x[:1])
            model.set_weights(ref.get_weights())
            diff = float(np.max(np.abs(model(x[:8]).numpy() - ref_out)))
            assert diff < 1e-4, (name, diff)
        first_loss = {n: float(m.train_on_batch(x, y)) for n, m in variants.items()}  # traces
        jit_resolved = {n: str(m.jit_compile) for n, m in variants.items()}
        print(f"\n## {cfg_name}: depth={depth} width={width} batch={batch}")
        print("first-step loss per variant (same weights, same batch): ", first_loss)
        print("resolved jit_compile: ", jit_resolved)
        for model in variants.values():
            for _ in range(FLAGS.warmup):
                model.train_on_batch(x, y)

        steps = FLAGS.steps
        if steps <= 0:
            t0 = time.perf_counter()
            for _ in range(3):
                variants["plain jit=False"].train_on_batch(x, y)
            steps = max(2, min(50, int(0.5 / ((time.perf_counter() - t0) / 3))))
        print(f"steps per variant per round: {steps}; rounds: {FLAGS.rounds}", flush=True)

        names = list(variants)
        times = {n: [] for n in names}
        cpu = {n: [] for n in names}  # process CPU time (all threads): less sensitive to other load
        for r in range(FLAGS.rounds):
            for n in names[r % len(names) :] + names[: r % len(names)]:
                c0, t0 = time.process_time(), time.perf_counter()
                for _ in range(steps):
                    variants[n].train_on_batch(x, y)  # returns numpy logs: synchronizes
                times[n].append((time.perf_counter() - t0) / steps * 1e3)
                cpu[n].append((time.process_time() - c0) / steps * 1e3)

        med = {n: statistics.median(times[n]) for n in names}
        cmed = {n: statistics.median(cpu[n]) for n in names}
        rows = []
        for n in names:
            q1, q3 = np.percentile(times[n], [25, 75])
            rows.append([n, f"{med[n]:.2f}", f"{q1:.2f}-{q3:.2f}", f"{min(times[n]):.2f}", f"{cmed[n]:.2f}"])
        harness.print_table(["variant", "median ms/step", "IQR ms", "min ms", "median CPU ms/step"], rows)
        comparisons = [
            ("pipe K=1 M=1", "plain jit=False"),
            ("pipe K=1 M=1", "plain jit=default"),
            ("plain jit=default", "plain jit=False"),
            ("pipe K=1 M=1", "plain jit=True"),
            (f"pipe K=1 M={M}", f"plain mb M={M}"),
            (f"plain mb M={M}", "plain jit=False"),
            (f"pipe K=1 M={M}", "plain jit=False"),
        ]
        if FLAGS.remat_rows:
            comparisons += [(f"pipe K=1 M={m} remat", f"pipe K=1 M={m}") for m in (1, M)]
        rows = []
        for a, b in comparisons:
            paired = statistics.median(x_ / y_ for x_, y_ in zip(times[a], times[b]))
            ratios = [f"{med[a] / med[b]:.3f}", f"{paired:.3f}", f"{cmed[a] / cmed[b]:.3f}"]
            rows.append([f"{a} / {b}", *ratios])
            summary.append([cfg_name, f"{a} / {b}", f"{med[a]:.2f}", f"{med[b]:.2f}", *ratios])
        harness.print_table(["ratio", "ratio of medians", "median paired ratio", "CPU-time ratio"], rows)
        results[cfg_name] = dict(steps_per_round=steps, times_ms=times, cpu_ms=cpu, first_loss=first_loss)

    headers = ["config", "A / B", "A median ms", "B median ms", "ratio of medians", "median paired ratio"]
    title = "## Summary (target: pipe K=1 M=1 / plain jit=False <= 1.05)"
    harness.print_table([*headers, "CPU-time ratio"], summary, title)
    harness.finish("overhead", configs=results)


if __name__ == "__main__":
    app.run(main)
