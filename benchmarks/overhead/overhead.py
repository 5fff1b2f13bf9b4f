"""Step-time overhead of tf_gpipe.PipelineModel with one stage versus plain Keras.

On identical layers and initial weights, same optimizer and loss, interleaved in one process
(``--rounds`` rounds of ``--steps`` ``train_on_batch`` steps per variant, the order rotating):
``PipelineModel(K=1, M=1, remat="never")`` against ``keras.Sequential`` with
``jit_compile`` False, Keras' default and True, and ``PipelineModel(K=1, M=4)`` against a
hand-written micro-batching ``train_step``. Reports median wall time, IQR, paired ratios and
process-CPU-time ratios. Variants, method and results: benchmarks/overhead/README.md.
Writes --out/overhead.{json,png}. Never run by the tests.
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
    "Configs to run, each 'mlp<depth>x<width>_b<batch>' (depth hidden Dense(width, relu) "
    "layers on a width-wide input, then a Dense(10) head).",
)
flags.DEFINE_integer("rounds", 60, "Interleaved rounds per config.")
flags.DEFINE_integer("steps", 0, "Steps per variant per round (0: auto, ~0.5 s worth).")
flags.DEFINE_integer("warmup", 5, "Warm-up steps per variant (after the first, tracing, step).")
flags.DEFINE_integer("micro_batches", 4, "M for the micro-batched rows.")
flags.DEFINE_bool("xla", True, "Also time plain keras.Sequential with jit_compile=True.")
flags.DEFINE_bool("remat_rows", False, "Also time PipelineModel(K=1) with remat='always' (M=1 and M=M).")
flags.DEFINE_string("optimizer", "adam", "Optimizer for every variant: adam or sgd.")
flags.DEFINE_integer("seed", 0, "Seed for weights and data.")
flags.DEFINE_string("out", harness.OUT_DIR, "Directory for the PNG and JSON.")


def parse_config(name: str):
    body, batch = name.split("_b")
    depth, width = body[len("mlp") :].split("x")
    return dict(name=name, depth=int(depth), width=int(width), batch=int(batch), classes=10)


def main(argv):
    del argv
    load_start = harness.loadavg()
    import keras
    import numpy as np
    import tensorflow as tf

    import tf_gpipe

    tf.get_logger().setLevel("ERROR")  # one retracing warning per model is expected here
    t_start = time.perf_counter()
    M = FLAGS.micro_batches

    class MicroBatchedSequential(keras.Model):
        """Plain Keras micro-batching: M forward/backward passes, gradients summed, one update."""

        def __init__(self, layers, num_micro_batches, **kwargs):
            super().__init__(**kwargs)
            self.seq = keras.Sequential(layers)
            self.num_micro_batches = num_micro_batches

        def call(self, x, training=None):
            return self.seq(x, training=training)

        def train_step(self, data):
            x, y, sw = keras.utils.unpack_x_y_sample_weight(data)
            n = tf.cast(tf.shape(x)[0], tf.float32)
            xs = tf.split(x, self.num_micro_batches)
            ys = tf.split(y, self.num_micro_batches)
            variables = self.trainable_variables
            total, preds, total_loss = None, [], 0.0
            for xi, yi in zip(xs, ys):
                with tf.GradientTape() as tape:
                    pi = self(xi, training=True)
                    # mean over the micro-batch, weighted so the sum is the mean over the batch
                    li = self.compute_loss(x=xi, y=yi, y_pred=pi, training=True)
                    li = li * (tf.cast(tf.shape(xi)[0], tf.float32) / n)
                g = tape.gradient(li, variables)
                total = g if total is None else [a + b for a, b in zip(total, g)]
                preds.append(pi)
                total_loss = total_loss + li
            self.optimizer.apply_gradients(zip(total, variables))
            self._loss_tracker.update_state(total_loss, sample_weight=tf.shape(x)[0])
            return self.compute_metrics(x, y, tf.concat(preds, 0), sw)

    def make_layers(cfg):
        # keras.layers.InputLayer, not keras.Input: PipelineModel before commit 3103868
        # rejected the KerasTensor that keras.Input returns (TypeError).
        return (
            [keras.layers.InputLayer(shape=(cfg["width"],))]
            + [keras.layers.Dense(cfg["width"], activation="relu") for _ in range(cfg["depth"])]
            + [keras.layers.Dense(cfg["classes"])]
        )

    def compile_(model, jit):
        opt = {
            "adam": lambda: keras.optimizers.Adam(1e-4),
            "sgd": lambda: keras.optimizers.SGD(1e-3),
        }[FLAGS.optimizer]()
        kwargs = {} if jit == "default" else {"jit_compile": jit}
        model.compile(
            optimizer=opt,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            **kwargs,
        )
        return model

    harness.header("tf_gpipe overhead benchmark", __name__)
    print(flush=True)

    results = {
        "env": harness.env_lines(),
        "tf_gpipe": harness.tf_gpipe_line(),
        "load_start": load_start,
        "configs": {},
    }
    table_rows = []
    for cfg_name in FLAGS.configs:
        cfg = parse_config(cfg_name)
        keras.utils.set_random_seed(FLAGS.seed)
        rng = np.random.default_rng(FLAGS.seed)
        x = tf.constant(rng.standard_normal((cfg["batch"], cfg["width"]), dtype=np.float32))
        y = tf.constant(rng.integers(0, cfg["classes"], cfg["batch"]), dtype=tf.int32)

        ref = keras.Sequential(make_layers(cfg))
        weights = ref.get_weights()

        variants = {}
        variants["pipe K=1 M=1"] = compile_(
            tf_gpipe.PipelineModel(make_layers(cfg), num_stages=1, num_micro_batches=1, remat="never"),
            False,
        )
        variants["plain jit=False"] = compile_(keras.Sequential(make_layers(cfg)), False)
        variants["plain jit=default"] = compile_(keras.Sequential(make_layers(cfg)), "default")
        if FLAGS.xla:
            variants["plain jit=True"] = compile_(keras.Sequential(make_layers(cfg)), True)
        variants[f"plain mb M={M}"] = compile_(MicroBatchedSequential(make_layers(cfg), M), False)
        variants[f"pipe K=1 M={M}"] = compile_(
            tf_gpipe.PipelineModel(make_layers(cfg), num_stages=1, num_micro_batches=M, remat="never"),
            False,
        )
        if FLAGS.remat_rows:
            variants["pipe K=1 M=1 remat"] = compile_(
                tf_gpipe.PipelineModel(make_layers(cfg), num_stages=1, num_micro_batches=1, remat="always"),
                False,
            )
            variants[f"pipe K=1 M={M} remat"] = compile_(
                tf_gpipe.PipelineModel(make_layers(cfg), num_stages=1, num_micro_batches=M, remat="always"),
                False,
            )

        # identical initial weights; check forward equality and the first-step loss
        ref_out = ref(x[:8]).numpy()
        first_loss, jit_resolved = {}, {}
        for name, model in variants.items():
            if not model.built:
                model(x[:1])
            model.set_weights(weights)
            diff = float(np.max(np.abs(model(x[:8]).numpy() - ref_out)))
            assert diff < 1e-4, (name, diff)
        for name, model in variants.items():
            first_loss[name] = float(model.train_on_batch(x, y))  # traces; loss before the update
            jit_resolved[name] = model.jit_compile
        print(f"## {cfg_name}: depth={cfg['depth']} width={cfg['width']} batch={cfg['batch']}")
        print(
            "first-step loss per variant (same weights, same batch): "
            + ", ".join(f"{k}={v:.6f}" for k, v in first_loss.items())
        )
        print("resolved jit_compile: " + ", ".join(f"{k}={v}" for k, v in jit_resolved.items()))
        for model in variants.values():
            for _ in range(FLAGS.warmup):
                model.train_on_batch(x, y)

        steps = FLAGS.steps
        if steps <= 0:
            model = variants["plain jit=False"]
            t0 = time.perf_counter()
            for _ in range(3):
                model.train_on_batch(x, y)
            per = (time.perf_counter() - t0) / 3
            steps = max(2, min(50, int(0.5 / per)))
        print(f"steps per variant per round: {steps}; rounds: {FLAGS.rounds}", flush=True)

        names = list(variants)
        times = {n: [] for n in names}
        cpu = {n: [] for n in names}  # process CPU time (all threads): less sensitive to other load
        for r in range(FLAGS.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for n in order:
                model = variants[n]
                c0, t0 = time.process_time(), time.perf_counter()
                for _ in range(steps):
                    model.train_on_batch(x, y)  # returns numpy logs: synchronizes
                times[n].append((time.perf_counter() - t0) / steps * 1e3)
                cpu[n].append((time.process_time() - c0) / steps * 1e3)
            if (r + 1) % 10 == 0:
                print(f"  round {r + 1}/{FLAGS.rounds}", flush=True)

        def q(v, p):
            return float(np.percentile(v, p))

        def paired(a, b, t=times):
            return statistics.median(x_ / y_ for x_, y_ in zip(t[a], t[b]))

        med = {n: statistics.median(times[n]) for n in names}
        cmed = {n: statistics.median(cpu[n]) for n in names}
        comparisons = [
            ("pipe K=1 M=1", "plain jit=False"),
            ("pipe K=1 M=1", "plain jit=default"),
            ("plain jit=default", "plain jit=False"),
        ]
        if FLAGS.xla:
            comparisons.append(("pipe K=1 M=1", "plain jit=True"))
        comparisons += [
            (f"pipe K=1 M={M}", f"plain mb M={M}"),
            (f"plain mb M={M}", "plain jit=False"),
            (f"pipe K=1 M={M}", "plain jit=False"),
        ]
        if FLAGS.remat_rows:
            comparisons += [
                ("pipe K=1 M=1 remat", "pipe K=1 M=1"),
                (f"pipe K=1 M={M} remat", f"pipe K=1 M={M}"),
            ]
        print()
        print(
            harness.md_table(
                ["variant", "median ms/step", "IQR ms", "min ms", "median CPU ms/step", "jit_compile"],
                [
                    [
                        n,
                        f"{med[n]:.2f}",
                        f"{q(times[n], 25):.2f}-{q(times[n], 75):.2f}",
                        f"{min(times[n]):.2f}",
                        f"{cmed[n]:.2f}",
                        str(jit_resolved[n]),
                    ]
                    for n in names
                ],
            )
        )
        print()
        comp_rows = []
        for a, b in comparisons:
            ratio = med[a] / med[b]
            pr = paired(a, b)
            cr = cmed[a] / cmed[b]
            comp_rows.append([f"{a} / {b}", f"{ratio:.3f}", f"{pr:.3f}", f"{cr:.3f}"])
            table_rows.append(
                [
                    cfg_name,
                    f"{a} / {b}",
                    f"{med[a]:.2f}",
                    f"{med[b]:.2f}",
                    f"{ratio:.3f}",
                    f"{pr:.3f}",
                    f"{cr:.3f}",
                ]
            )
        print(
            harness.md_table(
                ["ratio", "ratio of medians", "median paired ratio", "CPU-time ratio"], comp_rows
            )
        )
        print(flush=True)
        results["configs"][cfg_name] = {
            "cfg": cfg,
            "steps_per_round": steps,
            "times_ms": times,
            "cpu_ms": cpu,
            "median_ms": med,
            "median_cpu_ms": cmed,
            "first_step_loss": first_loss,
            "jit_compile": {k: str(v) for k, v in jit_resolved.items()},
        }
        del variants

    load_end = harness.loadavg()
    results["load_end"] = load_end
    print("## Summary (target: pipe K=1 M=1 / plain jit=False <= 1.05)\n")
    print(
        harness.md_table(
            [
                "config",
                "A / B",
                "A median ms",
                "B median ms",
                "ratio of medians",
                "median paired ratio",
                "CPU-time ratio",
            ],
            table_rows,
        )
    )
    print(f"\n- loadavg at end: {load_end}; total wall {time.perf_counter() - t_start:.0f} s")

    harness.save_json(os.path.join(FLAGS.out, "overhead.json"), results)
    plt = harness.pyplot()
    cfgs = list(results["configs"])
    fig, axes = plt.subplots(1, len(cfgs), figsize=(6.5 * len(cfgs), 4.8), squeeze=False)
    for ax, c in zip(axes[0], cfgs):
        t = results["configs"][c]["times_ms"]
        names = list(t)
        meds = [statistics.median(t[n]) for n in names]
        lo = [m - np.percentile(t[n], 25) for m, n in zip(meds, names)]
        hi = [np.percentile(t[n], 75) - m for m, n in zip(meds, names)]
        colors = ["tab:blue" if n.startswith("pipe") else "tab:gray" for n in names]
        ax.bar(range(len(names)), meds, yerr=[lo, hi], color=colors, capsize=3)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("ms / training step (median, IQR)")
        ax.set_title(c)
    fig.suptitle(f"tf_gpipe PipelineModel(K=1) vs plain Keras, {harness.cpu_model()}, {os.cpu_count()} cores")
    fig.tight_layout()
    harness.save_figure(fig, os.path.join(FLAGS.out, "overhead.png"), dpi=110)


if __name__ == "__main__":
    app.run(main)
