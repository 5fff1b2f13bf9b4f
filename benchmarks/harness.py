"""What every benchmark script shares: the environment header, one child process per
configuration, flags passed on to children, Markdown tables, JSON and plots.

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
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(REPO_ROOT, "benchmarks", "out")  # scratch output, git-ignored
MiB = 2.0**20
RESULT = "RESULT "

if REPO_ROOT not in sys.path:
    sys.path.append(REPO_ROOT)


# ---------------------------------------------------------------------------- environment


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


def vm(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


# ---------------------------------------------------------------------------- flags


def flag_values(module_name: str, skip: Sequence[str] = ()) -> Dict[str, Any]:
    """The flags a script defined (not absl's own), by name, less ``skip`` (its child-only flags)."""
    from absl import flags

    FLAGS = flags.FLAGS
    return {
        f.name: FLAGS[f.name].value
        for f in FLAGS.get_key_flags_for_module(sys.modules[module_name])
        if f.name not in skip
    }


def flag_args(names: Sequence[str]) -> List[str]:
    """``--name=value`` for each flag, lists comma-joined: the parent's settings for a child."""
    from absl import flags

    out = []
    for name in names:
        value = flags.FLAGS[name].value
        out.append(f"--{name}={','.join(value) if isinstance(value, list) else value}")
    return out


def header(title: str, module_name: Optional[str] = None, skip: Sequence[str] = (), extra=()) -> str:
    """Print the Markdown header every run starts with; return the load average at the start."""
    load_start = loadavg()
    print(f"# {title}\n")
    for line in env_lines():
        print(f"- {line}")
    for line in extra:
        print(f"- {line}")
    print(f"- {tf_gpipe_line()}")
    print(f"- loadavg at start: {load_start}")
    if module_name:
        ours = flag_values(module_name, skip)
        print("- flags: " + " ".join(f"--{k}={v}" for k, v in ours.items()))
    return load_start


# ---------------------------------------------------------------------------- child processes


def child_env(mmap_threshold: int = 0, tf_config: Optional[str] = None) -> Dict[str, str]:
    """The environment of a child: this checkout importable, TF quiet, optionally glibc's
    ``MALLOC_MMAP_THRESHOLD_`` (so freed big blocks go back to the OS and RSS follows live memory)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), REPO_ROOT) if p)
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    if mmap_threshold > 0:
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    env.pop("TF_CONFIG", None)
    if tf_config:
        env["TF_CONFIG"] = tf_config
    return env


def emit(result: Dict[str, Any], tag: str = RESULT) -> None:
    """A child's result: one JSON line its parent picks out of the output."""
    print(tag + json.dumps(result), flush=True)


def parse(stdout: str, tag: str = RESULT) -> List[Dict[str, Any]]:
    return [json.loads(s[len(tag) :]) for s in stdout.splitlines() if s.startswith(tag)]


def run_child(
    script: str, args: Sequence[str], env: Dict[str, str], tag: str = RESULT, timeout: Optional[float] = None
) -> Tuple[subprocess.CompletedProcess, List[Dict[str, Any]]]:
    """Run ``script`` with ``args`` in a fresh Python process; return it and its result lines."""
    proc = subprocess.run(
        [sys.executable, os.path.abspath(script), *args],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=timeout,
    )
    return proc, parse(proc.stdout, tag)


def stream_child(script: str, args: Sequence[str], env: Dict[str, str]) -> Iterator[Dict[str, Any]]:
    """Like ``run_child``, but yield each result as the child prints it; report a failure at the end."""
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(script), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None and proc.stderr is not None
    for line in proc.stdout:
        if line.startswith(RESULT):
            yield json.loads(line[len(RESULT) :])
    err = proc.stderr.read()
    if proc.wait() != 0:
        print(f"{' '.join(args)}: child failed (rc={proc.returncode})\n{err[-3000:]}")


# ---------------------------------------------------------------------------- output


def md_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(v if isinstance(v, str) else f"{v}" for v in r) + " |")
    return "\n".join(lines)


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
    for path in paths:
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            fig.savefig(path, dpi=dpi)
            print(f"- wrote {path}")
    pyplot().close(fig)
