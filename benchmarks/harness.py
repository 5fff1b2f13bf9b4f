"""Shared helpers for the benchmark scripts (environment report, Markdown tables).

Not a test module and not part of the tf_gpipe package.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from typing import List, Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(REPO_ROOT, "benchmarks", "out")

if REPO_ROOT not in sys.path:  # run as `python3 benchmarks/x.py` without PYTHONPATH;
    sys.path.append(REPO_ROOT)  # appended, so a tf_gpipe on PYTHONPATH takes precedence


def loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return f.read().strip()
    except OSError:
        return "n/a"


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def env_lines() -> List[str]:
    import keras
    import tensorflow as tf

    try:
        with open("/proc/meminfo") as f:
            mem_kib = int(f.readline().split()[1])
        mem = f"{mem_kib / 2**20:.1f} GiB"
    except (OSError, ValueError, IndexError):
        mem = "n/a"
    return [
        f"CPU: {cpu_model()} ({os.cpu_count()} logical cores visible, {len(os.sched_getaffinity(0))} usable)",
        f"RAM: {mem}; GPUs visible to TF: {len(tf.config.list_physical_devices('GPU'))}",
        f"Python {platform.python_version()}, TensorFlow {tf.__version__}, Keras {keras.__version__}, "
        f"NumPy {__import__('numpy').__version__}",
        f"TF threads: intra_op={tf.config.threading.get_intra_op_parallelism_threads()} "
        f"inter_op={tf.config.threading.get_inter_op_parallelism_threads()} (0 = TF default)",
    ]


def _git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", "-C", REPO_ROOT, *args], capture_output=True, text=True, check=False
        ).stdout.strip()
    except OSError:
        return ""


def tf_gpipe_line() -> str:
    """Which tf_gpipe is benchmarked: its path and, for this checkout, commit and local edits."""
    import tf_gpipe

    path = os.path.dirname(os.path.abspath(tf_gpipe.__file__))
    line = f"tf_gpipe {getattr(tf_gpipe, '__version__', '?')} from {path}"
    if path == os.path.join(REPO_ROOT, "tf_gpipe"):
        dirty = _git("status", "--porcelain", "--", "tf_gpipe")
        line += f", checkout HEAD {_git('rev-parse', '--short', 'HEAD')}"
        line += " with uncommitted tf_gpipe changes" if dirty else " (tf_gpipe clean)"
    else:
        line += f" (not this checkout's tf_gpipe; checkout HEAD is {_git('rev-parse', '--short', 'HEAD')})"
    snap = os.path.join(path, os.pardir, "SNAPSHOT")
    if os.path.exists(snap):
        with open(snap) as f:
            line += f"; snapshot of {f.read().strip()}"
    return line


def md_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def fmt(v):
        return v if isinstance(v, str) else f"{v}"

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(fmt(v) for v in r) + " |")
    return "\n".join(lines)
