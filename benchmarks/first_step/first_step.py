"""The first training step (trace + compile + first run) of ``PipelineModel`` for every
schedule and remat mode against M, and of ``keras.Sequential`` on the same layers.

Model: a small GPT-style Transformer on K=4 logical CPUs (placement, not a speed-up): token
embedding, learned position embedding, ``--blocks`` pre-LN Transformer blocks (d=``--width``,
sequence ``--seq``, 4 heads), final LayerNorm, vocabulary head; Adam, batch ``--batch``,
``compile(jit_compile="auto")`` for every model, as a user would compile. The position
embedding and final LayerNorm are real Transformer parts that also give the model
``--blocks`` + 4 layers: 8 at the default 4 blocks, the fewest ``"interleaved"`` can cut
into K * v = 8 chunks, and 5 at ``--blocks=1``, still enough for K=4.

Cells: ``keras.Sequential``, then each of ``--schedules`` x ``--remat`` x ``--micro_batches``
(``"interleaved"`` with ``virtual_stages=2``). Each cell runs in a fresh process, because a
warm process reuses traces and compiled kernels, so the first-step cost is per process. The
cells run ``--repeats`` times, in order then reversed, so slow drift of the shared machine
falls on every cell alike; the tables give medians. A child times

* first: its first ``train_on_batch``, split into
  * trace: time inside the outermost ``func_graph_from_py_func`` calls (Python building the
    step's graph and every function in it), and
  * rest: the remainder (TensorFlow optimizing, partitioning and instantiating the graph,
    then running the step once);
* second: the second ``train_on_batch`` (a steady step, for scale).

``--step=tape`` times a custom training step instead (``__call__`` under a
``tf.GradientTape``, then ``optimizer.apply``, in one ``tf.function``); ``--embedding=false``
feeds float inputs through a Dense in place of the token embedding.

A configuration ``PipelineModel`` rejects (``"interleaved"`` needs M to be a multiple of K,
so M=1 is not a configuration; ``--micro_batch_loops=true`` with GPipe needs
``remat="always"``) is reported with PipelineModel's own message and the table takes the
smallest valid M as its base. Results: benchmarks/first_step/README.md.

    PYTHONPATH=. python benchmarks/first_step/first_step.py --repeats=2
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
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
STAGES, VIRTUAL_STAGES, HEADS = 4, 2, 4
# The targets for the largest M: against M=1 of the same schedule, and against Sequential.
TARGET_VS_BASE, TARGET_VS_SEQUENTIAL = 1.3, 1.5
SEQUENTIAL = "keras.Sequential"

flags.DEFINE_list("schedules", list(SCHEDULES), "Schedules: gpipe, 1f1b, interleaved, zb-h1.")
flags.DEFINE_list("remat", ["always", "never"], "remat modes of the pipelines.")
flags.DEFINE_list("micro_batches", ["1", "4", "16", "32"], "M values.")
flags.DEFINE_integer("repeats", 2, "Fresh processes per cell, alternated forward and reversed.")
flags.DEFINE_integer("blocks", 4, "Transformer blocks.")
flags.DEFINE_integer("width", 128, "Model width d.")
flags.DEFINE_integer("seq", 64, "Sequence length.")
flags.DEFINE_integer("batch", 32, "Mini-batch size.")
flags.DEFINE_integer("vocab", 512, "Vocabulary size.")
flags.DEFINE_enum(
    "micro_batch_loops", "auto", ["auto", "true", "false"], "PipelineModel(micro_batch_loops=...)."
)
flags.DEFINE_enum(
    "step",
    "fit",
    ["fit", "tape"],
    "What the first step runs: train_on_batch, or a custom training step (__call__ under a "
    "tf.GradientTape, then optimizer.apply, in one tf.function).",
)
flags.DEFINE_bool(
    "embedding",
    True,
    "Token embedding (int inputs); false: float inputs of width --width through a Dense "
    "(with no Embedding, a custom step's forward can be a loop: docs/api.md).",
)
flags.DEFINE_enum(
    "model",
    "transformer",
    ["transformer", "vit"],
    "transformer: the GPT-style list of layers above; vit: keras-io's Vision Transformer "
    "(CIFAR-100 shapes, augmentation, 8 blocks of d=64, a 2048-1024 head), a functional model "
    "that each pipeline cell cuts with PipelineModel.from_model, as a user would port it; its "
    "unsplit functional model takes keras.Sequential's place.",
)
flags.DEFINE_bool(
    "compute_loss_override",
    False,
    "The models subclasses overriding compute_loss (the compiled loss plus 1e-3 * mean(y_pred**2), "
    "a mean over examples; --model=transformer): called per micro-batch by 1f1b, interleaved, zb-h1.",
)
flags.DEFINE_string("out", os.path.join(harness.OUT_DIR, "first_step.json"), "JSON of the run.")
flags.DEFINE_bool("child", False, "Internal: one cell (M=0: keras.Sequential) in this process.")


# ---------------------------------------------------------------------------- child


def _layers():
    import keras

    class PositionEmbedding(keras.layers.Layer):
        """A learned position vector added to each position's token embedding."""

        def build(self, input_shape):
            init = keras.initializers.RandomNormal(stddev=0.02)
            self.table = self.add_weight(shape=tuple(input_shape[1:]), initializer=init, name="table")

        def call(self, x):
            return x + self.table

    d = FLAGS.width
    if FLAGS.embedding:
        layers = [keras.Input((FLAGS.seq,), dtype="int32"), keras.layers.Embedding(FLAGS.vocab, d)]
    else:
        layers = [keras.Input((FLAGS.seq, d)), keras.layers.Dense(d)]
    layers += [PositionEmbedding()]
    layers += [harness.transformer_block(d, HEADS) for _ in range(FLAGS.blocks)]
    return layers + [keras.layers.LayerNormalization(), keras.layers.Dense(FLAGS.vocab)]


def _vit():
    """keras-io's "Image classification with Vision Transformer", as written there (its
    Normalization given CIFAR's rough moments instead of adapted)."""
    import keras
    from keras import layers, ops

    size, patch, d, heads, blocks = 72, 6, 64, 4, 8
    num_patches = (size // patch) ** 2

    class Patches(layers.Layer):
        def call(self, images):
            n = ops.shape(images)[0]
            patches = keras.ops.image.extract_patches(images, size=patch)
            return ops.reshape(patches, (n, num_patches, patch * patch * 3))

    class PatchEncoder(layers.Layer):
        def __init__(self):
            super().__init__()
            self.projection = layers.Dense(d)
            self.position_embedding = layers.Embedding(num_patches, d)

        def call(self, patches):
            positions = ops.expand_dims(ops.arange(0, num_patches, 1), axis=0)
            return self.projection(patches) + self.position_embedding(positions)

    def mlp(x, units, rate):
        for u in units:
            x = layers.Dropout(rate)(layers.Dense(u, activation=keras.activations.gelu)(x))
        return x

    augment = keras.Sequential(
        [
            layers.Normalization(mean=[0.5, 0.5, 0.5], variance=[0.07, 0.07, 0.07]),
            layers.Resizing(size, size),
            layers.RandomFlip("horizontal"),
            layers.RandomRotation(factor=0.02),
            layers.RandomZoom(height_factor=0.2, width_factor=0.2),
        ],
        name="data_augmentation",
    )
    inputs = keras.Input((32, 32, 3))
    encoded = PatchEncoder()(Patches()(augment(inputs)))
    for _ in range(blocks):
        x1 = layers.LayerNormalization(epsilon=1e-6)(encoded)
        attention = layers.MultiHeadAttention(num_heads=heads, key_dim=d, dropout=0.1)(x1, x1)
        x2 = layers.Add()([attention, encoded])
        x3 = mlp(layers.LayerNormalization(epsilon=1e-6)(x2), [2 * d, d], 0.1)
        encoded = layers.Add()([x3, x2])
    x = layers.Dropout(0.5)(layers.Flatten()(layers.LayerNormalization(epsilon=1e-6)(encoded)))
    return keras.Model(inputs, layers.Dense(100)(mlp(x, [2048, 1024], 0.5)))


def _model(schedule: str, remat: str, m: int, devices):
    """The compiled model of one cell (M=0: keras.Sequential), seeded so every cell starts alike."""
    import keras

    import tf_gpipe

    keras.utils.set_random_seed(0)
    loops = {"auto": "auto", "true": True, "false": False}[FLAGS.micro_batch_loops]
    pipelined = dict(
        num_stages=STAGES,
        num_micro_batches=m,
        devices=devices,
        remat=remat,
        schedule=schedule,
        virtual_stages=VIRTUAL_STAGES if schedule == "interleaved" else 1,
        micro_batch_loops=loops,
    )
    sequential, pipeline = keras.Sequential, tf_gpipe.PipelineModel
    if FLAGS.compute_loss_override:
        sequential, pipeline = _penalized(sequential), _penalized(pipeline)
    if FLAGS.model == "vit":
        model = pipeline.from_model(_vit(), **pipelined) if m else _vit()
    elif m == 0:
        model = sequential(_layers())
    else:
        model = pipeline(_layers(), **pipelined)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss, jit_compile="auto")
    return model


def _penalized(base):
    """``base`` with ``compute_loss`` overridden, as a user adds a penalty to the compiled loss."""
    from keras import ops

    class Penalized(base):
        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
            loss = super().compute_loss(x, y, y_pred, sample_weight, training=training)
            return loss + 1e-3 * ops.mean(ops.square(y_pred))

    return Penalized


def _data():
    import numpy as np

    rng = np.random.RandomState(0)
    if FLAGS.model == "vit":
        return rng.rand(FLAGS.batch, 32, 32, 3).astype("float32"), rng.randint(0, 100, (FLAGS.batch,))
    x, y = (rng.randint(0, FLAGS.vocab, (FLAGS.batch, FLAGS.seq)).astype("int32") for _ in "xy")
    if not FLAGS.embedding:
        x = rng.randn(FLAGS.batch, FLAGS.seq, FLAGS.width).astype("float32")
    return x, y


def _step(model):
    """``train_on_batch``, or (``--step=tape``) a custom training step as a user writes one."""
    if FLAGS.step == "fit":
        return model.train_on_batch
    import keras
    import tensorflow as tf

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.optimizer.build(model.trainable_variables)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            value = loss(y, model(x, training=True))
        model.optimizer.apply(tape.gradient(value, model.trainable_variables), model.trainable_variables)
        return value

    return step


def run_child() -> None:
    import tf_gpipe

    # Before anything else touches TensorFlow: the logical CPUs exist only if set up first.
    # keras.Sequential's process gets them too, so every cell starts the same runtime.
    devices = tf_gpipe.configure_virtual_cpus(STAGES)

    traced = harness.trace_clock()
    schedule, remat, m = FLAGS.schedules[0], FLAGS.remat[0], int(FLAGS.micro_batches[0])
    try:
        model = _model(schedule, remat, m, devices)
    except ValueError as e:  # a configuration PipelineModel rejects: report it, measure nothing
        return harness.emit({"invalid": str(e)})
    x, y = _data()
    step = _step(model)
    cpu, start = time.process_time(), time.perf_counter()
    step(x, y)
    first, cpu = time.perf_counter() - start, time.process_time() - cpu
    trace = traced[0]
    start = time.perf_counter()
    step(x, y)
    second = time.perf_counter() - start
    harness.emit(dict(first_s=first, trace_s=trace, rest_s=first - trace, cpu_s=cpu, second_s=second))


# ---------------------------------------------------------------------------- parent


def _unsplit() -> str:
    """The unsplit model the pipelines are measured against (the cell ``SEQUENTIAL``)."""
    return "the unsplit keras.Model" if FLAGS.model == "vit" else SEQUENTIAL


def _cells() -> list[tuple[str, str, int]]:
    cells = [(SEQUENTIAL, "-", 0)]
    for schedule in FLAGS.schedules:
        for remat in FLAGS.remat:
            cells += [(schedule, remat, int(m)) for m in FLAGS.micro_batches]
    return cells


def _measure(cells) -> dict[tuple[str, str, int], list[dict]]:
    runs: dict[tuple[str, str, int], list[dict]] = {c: [] for c in cells}
    for r in range(FLAGS.repeats):
        for schedule, remat, m in cells if r % 2 == 0 else list(reversed(cells)):
            if runs[schedule, remat, m] and "invalid" in runs[schedule, remat, m][0]:
                continue  # rejected at construction: the same answer every time
            config = dict(schedules=[schedule], remat=[remat], micro_batches=[m])
            runs[schedule, remat, m] += harness.child(**config) or [{"failed": True}]
    return runs


def _median(rs: list[dict], key: str) -> float | None:
    values = [r[key] for r in rs if key in r]
    return statistics.median(values) if values else None


def _fmt(value: float | None, spec: str = ".2f", scale: float = 1.0) -> str:
    return "-" if value is None else format(scale * value, spec)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a / b


def _mark(ratio: float | None, target: float) -> str:
    return "-" if ratio is None else f"{ratio:.2f} " + ("pass" if ratio <= target else "**FAIL**")


def report(runs) -> dict:
    seq = _median(runs[SEQUENTIAL, "-", 0], "first_s")
    ms = [int(m) for m in FLAGS.micro_batches]
    summary, notes = [], []
    for schedule in FLAGS.schedules:
        for remat in FLAGS.remat:
            cells = {m: runs[schedule, remat, m] for m in ms}
            first = {m: _median(rs, "first_s") for m, rs in cells.items()}
            valid = [m for m in ms if first[m] is not None]
            base = valid[0] if valid else None
            rows = []
            for m, rs in cells.items():
                if rs and "invalid" in rs[0]:
                    rows.append([m, "invalid", "", "", "", "", ""])
                    notes.append(f"{schedule}, remat={remat}, M={m}: {rs[0]['invalid']}")
                    continue
                if first[m] is None:  # the child failed: its error is in the progress output above
                    rows.append([m, "failed", "", "", "", "", ""])
                    continue
                vs_base = _ratio(first[m], first[base]) if base is not None else None
                rows.append([
                    m,
                    _fmt(first[m]),
                    _fmt(_median(rs, "trace_s")),
                    _fmt(_median(rs, "rest_s")),
                    _fmt(vs_base),
                    _fmt(_ratio(first[m], seq)),
                    _fmt(_median(rs, "second_s"), ".0f", 1e3),
                ])  # fmt: skip
            title = f"### {schedule}, remat={remat!r}"
            if base is not None and base != ms[0]:
                title += f" (base M={base}: M={ms[0]} is not a valid configuration)"
            headers = f"M|first step (s)|trace (s)|rest (s)|vs M={base}|vs {_unsplit()}|second step (ms)"
            harness.print_table(headers, rows, title)
            top = first[ms[-1]]
            summary.append([
                schedule,
                remat,
                f"M={ms[-1]}/M={base}",
                _mark(_ratio(top, first[base]) if base is not None else None, TARGET_VS_BASE),
                _mark(_ratio(top, seq), TARGET_VS_SEQUENTIAL),
            ])  # fmt: skip
    harness.print_table(
        f"schedule|remat|largest M / base M|ratio (target <= {TARGET_VS_BASE})"
        f"|largest M / {_unsplit()} (target <= {TARGET_VS_SEQUENTIAL})",
        summary,
        f"### Summary: K={STAGES}, {_unsplit()} first step {_fmt(seq)} s, medians of {FLAGS.repeats}",
    )
    if notes:
        print("\nNot valid configurations (PipelineModel's message):\n")
    for note in notes:
        print(f"- {note}")
    return {"sequential_first_s": seq, "summary": summary, "invalid": notes}


def main(argv):
    del argv
    if FLAGS.child:
        return run_child()
    unknown = set(FLAGS.schedules) - set(SCHEDULES)
    if unknown:
        raise app.UsageError(f"unknown schedules {sorted(unknown)}; use {', '.join(SCHEDULES)}")
    extra = [f"K={STAGES} logical CPUs; interleaved with virtual_stages={VIRTUAL_STAGES}"]
    harness.header("First training step: every schedule and remat mode against M", extra=extra)
    runs = _measure(_cells())
    data = report(runs)
    print(f"\n- loadavg at end: {harness.loadavg()}")
    saved = dict(env=harness.env_lines(), tf_gpipe=harness.tf_gpipe_line())
    saved.update(flags=harness.flag_values(skip=("child",)))
    saved.update(data, runs={f"{s}:{r}:{m}": rs for (s, r, m), rs in runs.items()})
    print(f"- wrote {harness.save_json(FLAGS.out, saved)}")


if __name__ == "__main__":
    app.run(main)
