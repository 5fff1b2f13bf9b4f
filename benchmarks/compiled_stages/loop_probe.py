"""Probe for the next step of "compiled stages": does a loop over clock ticks make the first
training step flat in M? Not tf_gpipe's engine: a stand-alone GPipe step over K stage
functions, written two ways around the same functions:

* ``unrolled``: one call per (stage, micro-batch), as tf_gpipe's executor builds it today
  (O(K x M) call sites);
* ``loop``: a ``tf.while_loop`` over the M + K - 1 clock ticks of the forward pass and another
  over those of the backward, each tick calling every stage once under a ``tf.cond``
  (O(K) call sites); each stage's inputs and output gradients wait in TensorArrays.

Both: ``--blocks`` pre-LN Transformer blocks (as compiled_stages.py) cut into K stages on K
logical CPUs, equal micro-batches, every stage re-materialized (its backward replays its
forward), dense gradients summed into variables inside the backward function, one Adam
update. Each (mode, M) runs in a fresh process; the first call (trace + optimize + run) and
the second are timed, and the two losses printed so the modes can be checked to agree.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import harness  # also puts the repo root on sys.path
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_list("modes", ["unrolled", "loop"], "Step builders: unrolled, loop.")
flags.DEFINE_list("micro_batches", ["1", "4", "16", "32"], "M values.")
flags.DEFINE_integer("stages", 4, "K.")
flags.DEFINE_integer("blocks", 8, "Transformer blocks.")
flags.DEFINE_integer("width", 128, "Model width d.")
flags.DEFINE_integer("seq", 64, "Sequence length.")
flags.DEFINE_integer("batch", 32, "Mini-batch size (a multiple of every M).")
flags.DEFINE_integer("repeats", 1, "Fresh processes per configuration (median taken).")
flags.DEFINE_string("out", harness.OUT_DIR, "Directory for the JSON.")
flags.DEFINE_bool("child", False, "Internal: one measurement.")


def _measure(mode: str, M: int) -> dict:
    import keras
    import tensorflow as tf

    K, B, D, S = FLAGS.stages, FLAGS.batch, FLAGS.width, FLAGS.seq
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * K)
    devs = [d.name for d in tf.config.list_logical_devices("CPU")]
    keras.utils.set_random_seed(0)

    stages, sums = [], []
    for s in range(K):
        with tf.device(devs[s]):
            x = keras.Input((S, D))
            y = x
            for _ in range(FLAGS.blocks // K):
                y = harness.transformer_block(D)(y)
            stages.append(keras.Model(x, y))
            sums.append([tf.Variable(tf.zeros_like(v)) for v in stages[s].trainable_variables])
    weights = [v for st in stages for v in st.trainable_variables]
    opt = keras.optimizers.Adam(1e-3)
    opt.build(weights)
    options = dict(reduce_retracing=True, autograph=False, experimental_attributes={"_noinline": True})

    def functions(model, total):
        def forward(x):
            return model(x, training=True)

        def backward(x, dy):  # replay, differentiate, add to the sums
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = model(x, training=True)
            dx, *grads = tape.gradient(y, [x, *model.trainable_variables], output_gradients=dy)
            with tf.control_dependencies([a.assign_add(g) for a, g in zip(total, grads)]):
                return tf.identity(dx)

        return tf.function(forward, **options), tf.function(backward, **options)

    fns = [functions(stages[s], sums[s]) for s in range(K)]

    def loss_and_grad(outputs, y):
        with tf.GradientTape() as tape:
            tape.watch(outputs)
            loss = tf.reduce_mean(tf.square(outputs - y))
        return loss, tape.gradient(loss, outputs)

    def zero():
        for a in (a for total in sums for a in total):
            a.assign(tf.zeros_like(a))

    def update():
        opt.apply_gradients(zip([a.read_value() for total in sums for a in total], weights))

    @tf.function(autograph=False)
    def unrolled(x, y):
        zero()
        acts = [list(tf.split(x, M))] + [[None] * M for _ in range(K)]
        for t in range(M + K - 1):
            for s in range(K):
                if 0 <= t - s < M:
                    with tf.device(devs[s]):
                        acts[s + 1][t - s] = fns[s][0](acts[s][t - s])
        loss, g = loss_and_grad(tf.concat(acts[K], 0), y)
        grads = tf.split(g, M)
        for t in range(M + K - 1):
            for s in reversed(range(K)):
                m = M - 1 - (t - (K - 1 - s))
                if 0 <= m < M:
                    with tf.device(devs[s]):
                        grads[m] = fns[s][1](acts[s][m], grads[m])
        update()
        return loss

    @tf.function(autograph=False)
    def loop(x, y):
        zero()
        T, shape = M + K - 1, [B // M, S, D]
        xs = tf.reshape(x, [M, *shape])

        # Forward: at tick t stage s runs micro-batch t - s; its output is written at index t.
        def forward_tick(t, *outs):
            written = []
            for s in range(K):
                m = t - s
                with tf.device(devs[s]):
                    inp = (
                        xs[tf.clip_by_value(m, 0, M - 1)]
                        if s == 0
                        else outs[s - 1].read(tf.maximum(t - 1, 0))
                    )
                    run = tf.logical_and(m >= 0, m < M)
                    out = tf.cond(run, lambda s=s, inp=inp: fns[s][0](inp), lambda: tf.zeros(shape))
                written.append(outs[s].write(t, out))
            return (t + 1, *written)

        outs = [tf.TensorArray(tf.float32, size=T, element_shape=shape) for _ in range(K)]
        _, *outs = tf.while_loop(lambda t, *_: t < T, forward_tick, (tf.constant(0), *outs))
        stacked = [xs] + [o.stack() for o in outs]  # stage s's input for m: stacked[s][m + s - 1]
        loss, g = loss_and_grad(tf.reshape(stacked[K][K - 1 :], [B, S, D]), y)
        gs = tf.reshape(g, [M, *shape])

        # Backward: at tick u stage s runs micro-batch M - 1 - (u - (K - 1 - s)).
        def backward_tick(u, *grads):
            grads = list(grads)
            written = list(grads)
            for s in reversed(range(K)):
                m = M - 1 - (u - (K - 1 - s))
                mc = tf.clip_by_value(m, 0, M - 1)
                with tf.device(devs[s]):
                    inp = xs[mc] if s == 0 else stacked[s][mc + s - 1]
                    dy = gs[mc] if s == K - 1 else grads[s].read(tf.maximum(u - 1, 0))
                    run = tf.logical_and(m >= 0, m < M)
                    dx = tf.cond(run, lambda s=s, inp=inp, dy=dy: fns[s][1](inp, dy), lambda: tf.zeros(shape))
                if s > 0:
                    written[s - 1] = grads[s - 1].write(u, dx)
            return (u + 1, *written)

        grads = [tf.TensorArray(tf.float32, size=T, element_shape=shape) for _ in range(K)]
        tf.while_loop(lambda u, *_: u < T, backward_tick, (tf.constant(0), *grads))
        update()
        return loss

    step = loop if mode == "loop" else unrolled
    x = tf.random.stateless_normal([B, S, D], [1, 2])
    y = tf.random.stateless_normal([B, S, D], [3, 4])
    start = time.perf_counter()
    first_loss = float(step(x, y))
    first = time.perf_counter() - start
    start = time.perf_counter()
    second_loss = float(step(x, y))
    return dict(
        mode=mode,
        M=M,
        first_s=first,
        second_s=time.perf_counter() - start,
        loss1=first_loss,
        loss2=second_loss,
    )


def main(argv):
    del argv
    if FLAGS.child:
        harness.emit(_measure(FLAGS.modes[0], int(FLAGS.micro_batches[0])))
        return
    print(harness.header("Loop over clock ticks vs one call per (stage, micro-batch): first step"))
    import statistics

    runs: dict = {}
    for _ in range(FLAGS.repeats):
        for m in FLAGS.micro_batches:
            for mode in FLAGS.modes:  # alternated
                runs.setdefault((mode, m), []).extend(harness.child(modes=[mode], micro_batches=[m]))
    first = {k: statistics.median(r["first_s"] for r in v) for k, v in runs.items() if v}
    rows = []
    for (mode, m), rs in runs.items():
        if not rs:
            continue
        base = first.get((mode, FLAGS.micro_batches[0]))
        rows.append(
            [
                mode,
                m,
                f"{first[(mode, m)]:.1f}",
                f"{first[(mode, m)] / base:.2f}" if base else "",
                f"{1e3 * statistics.median(r['second_s'] for r in rs):.0f}",
                f"{rs[0]['loss1']:.6f} / {rs[0]['loss2']:.6f}",
            ]
        )
    harness.print_table(
        f"step|M|first step (s)|vs M={FLAGS.micro_batches[0]}|second step (ms)|losses (steps 1 / 2)", rows
    )
    print(harness.finish("loop_probe", runs=[r for v in runs.values() for r in v]))


if __name__ == "__main__":
    app.run(main)
