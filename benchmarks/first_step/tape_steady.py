r"""Steady step of a custom training step: the loops against the step built out.

A custom training step (``__call__`` under a ``tf.GradientTape``, then ``optimizer.apply``,
one ``tf.function``) on the K=4 Transformer of ``first_step.py`` with a Dense where the
token embedding was, GPipe, ``remat="always"``, in one process:

* ``loops``: ``micro_batch_loops=True``, the loop running K micro-batches at once;
* ``loops_all_at_once``: the same loop allowed to run all M at once (what TensorFlow's
  gradient of it then also does);
* ``built_out``: ``micro_batch_loops=False``, one stage call per micro-batch.

Each variant is traced and run twice, then timed in rounds of ``--steps`` steps, the order
rotating each round; the table gives the median over the rounds of the mean step.

    PYTHONPATH=. python benchmarks/first_step/tape_steady.py --micro_batches=4,16
"""

from __future__ import annotations

import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import harness
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_list("micro_batches", ["4", "16"], "M values.")
flags.DEFINE_integer("rounds", 7, "Timed rounds (the order of the variants rotates).")
flags.DEFINE_integer("steps", 5, "Steps per variant and round.")
flags.DEFINE_integer("width", 128, "Model width d.")
flags.DEFINE_integer("seq", 64, "Sequence length.")
flags.DEFINE_integer("batch", 32, "Mini-batch size.")

VARIANTS = ("loops", "loops_all_at_once", "built_out")


def _steps(m: int) -> dict:
    import keras
    import numpy as np
    import tensorflow as tf

    import tf_gpipe
    from tf_gpipe import loop_state

    d = FLAGS.width
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rng = np.random.RandomState(0)
    x = tf.constant(rng.randn(FLAGS.batch, FLAGS.seq, d).astype("float32"))
    y = tf.constant(rng.randint(0, 512, (FLAGS.batch, FLAGS.seq)))
    run, steps = loop_state.run, {}
    for name in VARIANTS:
        keras.utils.set_random_seed(0)
        layers = [keras.Input((FLAGS.seq, d)), keras.layers.Dense(d)]
        layers += [harness.transformer_block(d, 4) for _ in range(4)]
        layers += [keras.layers.LayerNormalization(), keras.layers.Dense(512)]
        pm = tf_gpipe.PipelineModel(
            layers, num_stages=4, num_micro_batches=m, remat="always", micro_batch_loops=name != "built_out"
        )
        pm.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss)
        pm.optimizer.build(pm.trainable_variables)

        def step(x, y, pm=pm):
            with tf.GradientTape() as tape:
                value = loss(y, pm(x, training=True))
            pm.optimizer.apply(tape.gradient(value, pm.trainable_variables), pm.trainable_variables)
            return value

        steps[name] = tf.function(step)
        if name == "loops_all_at_once":  # the loop built while run() ignores its bound
            loop_state.run = lambda state, n, iteration, parallel=None: run(state, n, iteration)
        try:
            for _ in range(2):
                steps[name](x, y).numpy()
        finally:
            loop_state.run = run
    times: dict = {n: [] for n in VARIANTS}
    for r in range(FLAGS.rounds):
        for name in VARIANTS[r % 3 :] + VARIANTS[: r % 3]:
            start = time.perf_counter()
            for _ in range(FLAGS.steps):
                value = steps[name](x, y)
            value.numpy()
            times[name].append((time.perf_counter() - start) / FLAGS.steps * 1000)
    return {n: statistics.median(t) for n, t in times.items()}


def main(argv):
    del argv
    import tf_gpipe

    tf_gpipe.configure_virtual_cpus(4)
    harness.header("Custom training step: steady step, loops against built out")
    rows = []
    for m in map(int, FLAGS.micro_batches):
        got = _steps(m)
        base = got["built_out"]
        rows.append([m, *(f"{got[n]:.1f}" for n in VARIANTS), f"{got['loops'] / base:.2f}"])
    harness.print_table(["M", *(f"{n} (ms)" for n in VARIANTS), "loops / built_out"], rows)


if __name__ == "__main__":
    app.run(main)
