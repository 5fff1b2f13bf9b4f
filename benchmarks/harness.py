"""What every benchmark script shares: the run's header, one child process per configuration,
Markdown tables, the JSON of a run and plots.

Each script lives in ``benchmarks/<name>/`` and starts with::

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import harness

which also puts the repository root on ``sys.path`` (appended, so a tf_gpipe on
``PYTHONPATH``, e.g. a frozen snapshot, takes precedence). Not part of the tf_gpipe package.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(REPO_ROOT, "benchmarks", "out")  # scratch output, git-ignored
MiB = 2.0**20
RESULT = "RESULT "
# Flags that select what a process does rather than what it measures: never passed to children.
_NOT_PASSED = ("child", "from_json", "replot", "out", "image")
_START: dict[str, Any] = {}

if REPO_ROOT not in sys.path:
    sys.path.append(REPO_ROOT)


# ---------------------------------------------------------------------------- environment


def _read(path: str, default: str = "n/a") -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return default


def loadavg() -> str:
    return _read("/proc/loadavg")


def _run(*cmd: str) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return ""


def env_lines() -> list[str]:
    import keras
    import numpy
    import tensorflow as tf

    mem = _read("/proc/meminfo", "MemTotal: 0 kB").split()[1]
    cpu = [s.split(":", 1)[1].strip() for s in _run("lscpu").splitlines() if s.startswith("Model name:")]
    cpu = (cpu or [platform.processor()])[0]
    threads = tf.config.threading
    return [
        f"CPU: {cpu} ({os.cpu_count()} logical cores visible, {len(os.sched_getaffinity(0))} usable)",
        f"RAM: {int(mem) / 2**20:.1f} GiB; GPUs visible to TF: {len(tf.config.list_physical_devices('GPU'))}",
        f"Python {platform.python_version()}, TensorFlow {tf.__version__}, Keras {keras.__version__}, "
        f"NumPy {numpy.__version__}",
        f"TF threads: intra_op={threads.get_intra_op_parallelism_threads()} "
        f"inter_op={threads.get_inter_op_parallelism_threads()} (0 = TF default)",
    ]


def tf_gpipe_line() -> str:
    """Which tf_gpipe is benchmarked: its path and, for this checkout, commit and local edits."""
    import tf_gpipe

    path = os.path.dirname(os.path.abspath(tf_gpipe.__file__))
    head = _run("git", "-C", REPO_ROOT, "rev-parse", "--short", "HEAD")
    line = f"tf_gpipe {getattr(tf_gpipe, '__version__', '?')} from {path}"
    if path == os.path.join(REPO_ROOT, "tf_gpipe"):
        dirty = _run("git", "-C", REPO_ROOT, "status", "--porcelain", "--", "tf_gpipe")
        line += f", checkout HEAD {head}" + (" with uncommitted tf_gpipe changes" if dirty else " (clean)")
    else:
        line += f" (not this checkout's tf_gpipe; checkout HEAD is {head})"
    snapshot = _read(os.path.join(path, os.pardir, "SNAPSHOT"), "")
    return line + (f"; snapshot of {snapshot}" if snapshot else "")


def vm(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    for line in _read("/proc/self/status").splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


# ---------------------------------------------------------------------------- flags


def flag_values(module_name: str = "__main__", skip: Sequence[str] = ()) -> dict[str, Any]:
    """The flags a script defined (not absl's own), by name, less ``skip``."""
    from absl import flags

    module = sys.modules[module_name]
    return {f.name: f.value for f in flags.FLAGS.get_key_flags_for_module(module) if f.name not in skip}


def _arg(name: str, value: Any) -> str:
    return f"--{name}={','.join(map(str, value)) if isinstance(value, list) else value}"


def flag_args(names: Sequence[str]) -> list[str]:
    """``--name=value`` for each flag, lists comma-joined: the parent's settings for a child."""
    from absl import flags

    return [_arg(name, flags.FLAGS[name].value) for name in names]


def header(title: str, module_name: str = "__main__", skip: Sequence[str] = _NOT_PASSED, extra=()) -> str:
    """Print the Markdown header every run starts with; return the load average at the start."""
    _START.update(load=loadavg(), time=time.perf_counter())
    print(f"# {title}\n")
    for line in [*env_lines(), *extra, tf_gpipe_line(), f"loadavg at start: {_START['load']}"]:
        print(f"- {line}")
    print("- flags: " + " ".join(_arg(k, v) for k, v in flag_values(module_name, skip).items()), flush=True)
    return _START["load"]


def finish(name: str, **data: Any) -> str:
    """Print the load at the end and the wall time; save the run (``data`` and where it ran) as
    ``--out/<name>.json``."""
    from absl import flags

    load_end, wall = loadavg(), time.perf_counter() - _START.get("time", time.perf_counter())
    print(f"\n- loadavg at end: {load_end}; total wall {wall:.0f} s")
    saved = dict(env=env_lines(), tf_gpipe=tf_gpipe_line(), load_start=_START.get("load"), load_end=load_end)
    saved.update(flags=flag_values(skip=_NOT_PASSED), wall_s=wall, **data)
    return save_json(os.path.join(flags.FLAGS.out, f"{name}.json"), saved)


def load_json(path: str) -> dict[str, Any]:
    with open(path) as f:
        data = json.load(f)
    print(f"# from {path}: {data.get('tf_gpipe')}; load {data.get('load_start')} to {data.get('load_end')}")
    return data


# ---------------------------------------------------------------------------- child processes


def child_env(mmap_threshold: int = 0, tf_config: str | None = None) -> dict[str, str]:
    """The environment of a child: this checkout importable, TF quiet, optionally glibc's
    ``MALLOC_MMAP_THRESHOLD_`` (so freed big blocks go back to the OS and RSS follows live memory)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), REPO_ROOT) if p)
    env.pop("TF_CONFIG", None)
    if mmap_threshold > 0:
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    if tf_config:
        env["TF_CONFIG"] = tf_config
    return env


def emit(result: dict[str, Any]) -> None:
    """A child's result: one JSON line its parent picks out of the output."""
    print(RESULT + json.dumps(result), flush=True)


def child(env: dict[str, str] | None = None, timeout: float | None = None, **config) -> list[dict]:
    """Run this script again with ``--child``, its own flags and ``config``'s values in their place
    (one configuration: e.g. ``stages=[2]`` for a list flag); return its results, or ``[]`` after
    printing why it failed."""
    values = dict(flag_values(skip=_NOT_PASSED), **config)
    args = ["--child", *(_arg(k, v) for k, v in values.items() if v is not None)]
    cmd = [sys.executable, os.path.abspath(sys.argv[0]), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env or child_env(), timeout=timeout)
    results = [json.loads(s[len(RESULT) :]) for s in proc.stdout.splitlines() if s.startswith(RESULT)]
    name = " ".join(_arg(k, v) for k, v in config.items())
    if proc.returncode or not results:
        print(f"{name}: child failed (rc={proc.returncode})\n{proc.stderr[-3000:]}", flush=True)
        return []
    for r in results:  # progress: the scalars of each result
        print(name, " ".join(f"{k}={v:.4g}" for k, v in r.items() if isinstance(v, float)), flush=True)
    return results


def stream_child(script: str, args: Sequence[str], env: dict[str, str]) -> Iterator[dict[str, Any]]:
    """Run ``script`` with ``args``; yield each result as the child prints it, report a failure at the end."""
    cmd = [sys.executable, os.path.abspath(script), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None and proc.stderr is not None
    for line in proc.stdout:
        if line.startswith(RESULT):
            yield json.loads(line[len(RESULT) :])
    err = proc.stderr.read()
    if proc.wait() != 0:
        print(f"{' '.join(args)}: child failed (rc={proc.returncode})\n{err[-3000:]}")


# ---------------------------------------------------------------------------- output


def trace_clock() -> list[float]:
    """Start timing Python tracing: the returned one-element list holds the seconds spent
    inside the outermost ``func_graph_from_py_func`` calls since (the step's graph and every
    function in it; nested traces count in their outermost one's time)."""
    from tensorflow.python.framework import func_graph  # private: the probe's clock

    depth, traced = [0], [0.0]
    original = func_graph.func_graph_from_py_func

    def timed(*args, **kwargs):
        depth[0] += 1
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            depth[0] -= 1
            if depth[0] == 0:
                traced[0] += time.perf_counter() - start

    func_graph.func_graph_from_py_func = timed
    return traced


def transformer_block(d: int, heads: int = 4):
    """A pre-LN Transformer block of width ``d`` (causal attention, 4d GELU feed-forward):
    the block of the benchmarks' small Transformer stacks."""
    import keras

    class Block(keras.layers.Layer):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.ln1, self.ln2 = keras.layers.LayerNormalization(), keras.layers.LayerNormalization()
            self.att = keras.layers.MultiHeadAttention(heads, d // heads)
            self.up, self.down = keras.layers.Dense(4 * d, activation="gelu"), keras.layers.Dense(d)

        def call(self, x):
            h = self.ln1(x)
            x = x + self.att(h, h, use_causal_mask=True)
            return x + self.down(self.up(self.ln2(x)))

    return Block()


def tied_head(embedding):
    """Logits from ``embedding``'s own matrix (weight tying, as GPT-2's head): a layer that
    reads the embedding's weight, which the pipeline keeps on the last stage using it."""
    import keras

    class TiedHead(keras.layers.Layer):
        def __init__(self, embedding, **kwargs):
            super().__init__(**kwargs)
            self.embedding = embedding

        def call(self, h):
            return keras.ops.matmul(h, keras.ops.transpose(self.embedding.embeddings))

    return TiedHead(embedding)


def micro_batched_sequential(layers, num_micro_batches: int):
    """What a user would otherwise run: a ``keras.Sequential`` of ``layers`` that trains each
    mini-batch as ``num_micro_batches`` forward/backward passes, gradients summed (an
    Embedding's rows kept as rows, as Keras does), one optimizer update."""
    import keras
    import tensorflow as tf

    def add(a, b):
        if isinstance(a, tf.IndexedSlices):
            return tf.IndexedSlices(
                tf.concat([a.values, b.values], 0), tf.concat([a.indices, b.indices], 0), a.dense_shape
            )
        return a + b

    class MicroBatchedSequential(keras.Model):
        def __init__(self, layers, num_micro_batches, **kwargs):
            super().__init__(**kwargs)
            self.seq, self.num_micro_batches = keras.Sequential(layers), num_micro_batches

        def call(self, x, training=None):
            return self.seq(x, training=training)

        def train_step(self, data):
            x, y, sw = keras.utils.unpack_x_y_sample_weight(data)
            n = tf.cast(tf.shape(x)[0], tf.float32)
            total, preds, total_loss = None, [], 0.0
            for xi, yi in zip(tf.split(x, self.num_micro_batches), tf.split(y, self.num_micro_batches)):
                with tf.GradientTape() as tape:
                    pi = self(xi, training=True)
                    variables = self.trainable_variables  # built by the first call
                    # mean over the micro-batch, weighted so the sum is the mean over the batch
                    li = self.compute_loss(x=xi, y=yi, y_pred=pi, training=True)
                    li = li * (tf.cast(tf.shape(xi)[0], tf.float32) / n)
                g = tape.gradient(li, variables)
                total = g if total is None else [add(a, b) for a, b in zip(total, g)]
                preds.append(pi)
                total_loss = total_loss + li
            self.optimizer.apply_gradients(zip(total, variables))
            self._loss_tracker.update_state(total_loss, sample_weight=tf.shape(x)[0])
            return self.compute_metrics(x, y, tf.concat(preds, 0), sw)

    return MicroBatchedSequential(layers, num_micro_batches)


def dense_stack(K: int, M: int, remat: str, depth: int, width: int, batch: int):
    """The remat-memory model and batch: ``depth`` x Dense(width, relu) + Dense(10), as a
    ``PipelineModel`` of K stages and M micro-batches (``keras.Sequential`` for K = 0),
    compiled with SGD (no optimizer slots) and no XLA; a batch of ``batch`` examples on
    CPU:0. Returns ``(model, x, y)``."""
    import keras
    import numpy as np
    import tensorflow as tf

    import tf_gpipe

    keras.utils.set_random_seed(0)
    layers = [keras.layers.InputLayer(shape=(width,))]
    layers += [keras.layers.Dense(width, activation="relu") for _ in range(depth)]
    layers += [keras.layers.Dense(10)]
    if K > 0:
        model = tf_gpipe.PipelineModel(layers, num_stages=K, num_micro_batches=M, remat=remat)
    else:
        model = keras.Sequential(layers)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=keras.optimizers.SGD(1e-4), loss=loss, jit_compile=False)
    rng = np.random.default_rng(0)
    with tf.device("CPU:0"):
        x = tf.constant(rng.standard_normal((batch, width), dtype=np.float32))
        y = tf.constant(rng.integers(0, 10, batch), dtype=tf.int32)
    return model, x, y


def md_table(headers: str | Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """``headers``: a list, or one string with the headers between ``|``."""
    headers = headers.split("|") if isinstance(headers, str) else headers
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    return "\n".join(lines + ["| " + " | ".join(str(v) for v in r) + " |" for r in rows])


def print_table(headers, rows: Sequence[Sequence[object]], title: str = "") -> None:
    """A blank line, the title (if any) and the Markdown table."""
    print(f"\n{title}\n" * bool(title) + "\n" + md_table(headers, rows), flush=True)


def save_json(path: str, data: Any) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    return path


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (imported late: most runs need no plot)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, *paths: str, dpi: int = 100) -> None:
    """Save ``fig`` to every non-empty path (e.g. --out and a docs/images copy), then close it."""
    for path in filter(None, paths):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fig.savefig(path, dpi=dpi)
        print(f"- wrote {path}")
    pyplot().close(fig)
