"""Steady training step of the keras-io bidirectional LSTM (IMDB) pipelined, against plain Keras.

The model of keras-io's "Bidirectional LSTM on IMDB": int tokens -> Embedding(20000, 128) ->
Bidirectional(LSTM(64, return_sequences=True)) -> Bidirectional(LSTM(64)) -> Dense(1,
sigmoid), sequences of ``--maxlen`` tokens, batches of ``--batch`` (synthetic data). In one
process, alternated round by round: ``keras.Sequential`` (Keras' default ``jit_compile``),
plain Keras summing gradients over the same M micro-batches (what a user would otherwise
run), and ``PipelineModel(K, M)`` per remat mode (``micro_batch_loops`` as given). Prints the median
step, its ratio to Sequential, and, from one profiled step per variant, the ops executed,
the matmuls among them and the cross-device transfers. Results: benchmarks/recurrent/README.md.
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
flags.DEFINE_integer("stages", 2, "K.")
flags.DEFINE_integer("micro_batches", 4, "M.")
flags.DEFINE_integer("batch", 32, "Examples per step.")
flags.DEFINE_integer("maxlen", 200, "Tokens per example.")
flags.DEFINE_integer("rounds", 5, "Alternated rounds; one step per variant per round.")
flags.DEFINE_list(
    "pipelines",
    ["always", "always:built_out", "except_last", "never"],
    "PipelineModel variants, '<remat>' or '<remat>:built_out' (micro_batch_loops=False).",
)
flags.DEFINE_enum(
    "jit_compile", "auto", ["auto", "true", "false"], "compile(jit_compile=...) for every variant."
)
flags.DEFINE_bool("counts", True, "Profile one step per variant: ops, matmuls, transfers.")
flags.DEFINE_string("out", harness.OUT_DIR, "Directory for the JSON and the profiles.")


def _profile_counts(step, logdir: str) -> dict:
    """Ops executed, matmuls and _Send ops in one step, from the profiler's host trace."""
    import glob

    import tensorflow as tf
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    tf.profiler.experimental.start(logdir, tf.profiler.experimental.ProfilerOptions(host_tracer_level=3))
    step()
    tf.profiler.experimental.stop()
    space = xplane_pb2.XSpace()
    with open(sorted(glob.glob(f"{logdir}/plugins/profile/*/*.xplane.pb"))[-1], "rb") as f:
        space.ParseFromString(f.read())
    ops = matmuls = sends = 0
    for plane in space.planes:
        if plane.name != "/host:CPU":
            continue
        for line in plane.lines:
            for event in line.events:
                name = plane.event_metadata[event.metadata_id].name
                if ":" not in name:  # op events are "node:type"; the rest is the runtime's own
                    continue
                kind = name.rsplit(":", 1)[1]
                ops += 1
                matmuls += kind in ("MatMul", "_MklMatMul", "BatchMatMulV2")
                sends += kind == "_Send"
    return {"ops": ops, "matmuls": matmuls, "sends": sends}


def main(argv):
    del argv
    import keras
    import numpy as np

    import tf_gpipe

    tf_gpipe.configure_virtual_cpus(FLAGS.stages)
    import tensorflow as tf

    tf.get_logger().setLevel("ERROR")
    harness.header("tf_gpipe recurrent benchmark: keras-io bidirectional LSTM")
    K, M = FLAGS.stages, FLAGS.micro_batches

    def layers():
        keras.utils.set_random_seed(0)
        return [
            keras.Input((None,), dtype="int32"),
            keras.layers.Embedding(20000, 128),
            keras.layers.Bidirectional(keras.layers.LSTM(64, return_sequences=True)),
            keras.layers.Bidirectional(keras.layers.LSTM(64)),
            keras.layers.Dense(1, activation="sigmoid"),
        ]

    models = {"keras.Sequential": keras.Sequential(layers())}
    models[f"plain Keras, {M} micro-batches"] = harness.micro_batched_sequential(layers(), M)
    for spec in FLAGS.pipelines:
        remat, _, engine = spec.partition(":")
        micro_batch_loops = False if engine == "built_out" else "auto"
        name = f"PipelineModel remat={remat}" + (" (built out)" if engine == "built_out" else "")
        models[name] = tf_gpipe.PipelineModel(
            layers(), num_stages=K, num_micro_batches=M, remat=remat, micro_batch_loops=micro_batch_loops
        )
    for model in models.values():
        jit = {"auto": "auto", "true": True, "false": False}[FLAGS.jit_compile]
        model.compile(optimizer="adam", loss="binary_crossentropy", jit_compile=jit)

    rng = np.random.RandomState(0)
    x = rng.randint(1, 20000, size=(FLAGS.batch, FLAGS.maxlen)).astype("int32")
    y = rng.randint(0, 2, size=(FLAGS.batch, 1)).astype("float32")
    first = {}
    for name, model in models.items():
        start = time.perf_counter()
        model.train_on_batch(x, y)
        first[name] = time.perf_counter() - start
        model.train_on_batch(x, y)
    times: dict[str, list[float]] = {n: [] for n in models}
    order = list(models)
    for r in range(FLAGS.rounds):
        for name in order[r % len(order) :] + order[: r % len(order)]:  # the order rotates
            start = time.perf_counter()
            models[name].train_on_batch(x, y)
            times[name].append(time.perf_counter() - start)
    counts = {}
    if FLAGS.counts:
        for i, (name, model) in enumerate(models.items()):
            counts[name] = _profile_counts(
                lambda m=model: m.train_on_batch(x, y), os.path.join(FLAGS.out, f"lstm_profile_{i}")
            )
    base = statistics.median(times["keras.Sequential"])
    base_counts = counts.get("keras.Sequential")
    rows = []
    for name in models:
        med = statistics.median(times[name])
        row = [name, f"{first[name]:.1f}", f"{med:.3f}", f"{med / base:.2f}"]
        if counts:
            c = counts[name]
            row += [c["ops"], f"{c['ops'] / base_counts['ops']:.2f}", c["matmuls"], c["sends"]]
        rows.append(row)
    headers = ["variant", "first step s", "steady step s (median)", "/ Sequential"]
    if counts:
        headers += ["ops executed", "/ Sequential", "matmuls", "cross-device sends"]
    jit = {n: getattr(m, "jit_compile", None) for n, m in models.items() if not hasattr(m, "stage_jit")}
    stage_jit = {n: m.stage_jit for n, m in models.items() if hasattr(m, "stage_jit")}
    harness.print_table(
        headers,
        rows,
        f"K={K}, M={M}, batch {FLAGS.batch}, maxlen {FLAGS.maxlen}, {FLAGS.rounds} rounds; "
        f"Keras jit_compile {jit}; tf_gpipe stage_jit {sorted({str(v) for v in stage_jit.values()})}",
    )
    harness.finish("lstm_step", times=times, first=first, counts=counts)


if __name__ == "__main__":
    app.run(main)
