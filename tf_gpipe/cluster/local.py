"""LocalCluster: TensorFlow worker processes on 127.0.0.1 (tests, demos, benchmarks)."""

from __future__ import annotations

import atexit
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

__all__ = ["LocalCluster"]

WORKER_READY = "TF_GPIPE_WORKER_READY"  # what a worker prints once it listens (tf_gpipe.cluster.worker)
LIVE_CLUSTERS: weakref.WeakSet[LocalCluster] = weakref.WeakSet()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: str, n: int = 2000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


class LocalCluster:
    """Start ``num_workers`` TensorFlow servers as processes on 127.0.0.1; stop them after.

    Each worker is ``python -m tf_gpipe.cluster --worker``: a ``tf.distribute.Server``
    on a free loopback port, exactly what a worker on another host runs. The
    processes stop when the cluster is closed (``with`` block, ``close()``, interpreter
    exit) and, should this process die without closing, by themselves: each worker
    exits once its parent is gone, and after ``lifetime`` seconds if given.

    Args:
        num_workers: worker processes (tasks of job ``job_name``).
        job_name: the workers' job.
        devices_per_worker: logical CPU devices each worker exposes.
        threads: intra- and inter-op threads of each worker (0: TensorFlow's default).
        startup_timeout: seconds to wait for every worker to listen.
        lifetime: seconds after which a worker exits on its own (None: no limit).
        log_dir: where ``worker-K.log`` go (default: a new temporary directory).

    Example:

    ```python
    with LocalCluster(2) as workers:
        os.environ["TF_CONFIG"] = workers.tf_config   # for a training script started here
        subprocess.run([sys.executable, "train.py"], check=True, timeout=600)
    ```
    """

    def __init__(
        self,
        num_workers: int,
        job_name: str = "worker",
        devices_per_worker: int = 1,
        threads: int = 0,
        startup_timeout: float = 60.0,
        lifetime: float | None = None,
        log_dir: str | None = None,
        start: bool = True,
    ):
        if num_workers < 1:
            raise ValueError(f"tf_gpipe: num_workers must be >= 1, got {num_workers}.")
        self.job_name = job_name
        self.devices_per_worker = devices_per_worker
        self.threads = threads
        self.startup_timeout = startup_timeout
        self.lifetime = lifetime
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="tf_gpipe_cluster_")
        self.addresses = [f"127.0.0.1:{free_port()}" for _ in range(num_workers)]
        self._procs: list[subprocess.Popen | None] = [None] * num_workers
        self._closed = False
        LIVE_CLUSTERS.add(self)
        atexit.register(self.close)
        if start:
            self.start()

    # -- descriptions a client needs
    @property
    def num_workers(self) -> int:
        return len(self.addresses)

    @property
    def cluster_dict(self) -> dict[str, list[str]]:
        return {self.job_name: list(self.addresses)}

    @property
    def cluster_spec(self) -> tf.train.ClusterSpec:
        return tf.train.ClusterSpec(self.cluster_dict)

    @property
    def tf_config(self) -> str:
        """``TF_CONFIG`` for a client of this cluster (the client joins as job 'client')."""
        return json.dumps({"cluster": self.cluster_dict})

    def log(self, task: int) -> str:
        return os.path.join(self.log_dir, f"worker-{task}.log")

    def pid(self, task: int) -> int | None:
        proc = self._procs[task]
        return None if proc is None else proc.pid

    def alive(self, task: int) -> bool:
        proc = self._procs[task]
        return proc is not None and proc.poll() is None

    # -- lifecycle
    def _launch(self, task: int) -> subprocess.Popen:
        argv = [
            sys.executable,
            "-m",
            "tf_gpipe.cluster",
            "--worker",
            f"--cluster={json.dumps(self.cluster_dict)}",
            f"--job_name={self.job_name}",
            f"--task_index={task}",
            f"--virtual_cpus={self.devices_per_worker}",
            f"--threads={self.threads}",
            f"--parent_pid={os.getpid()}",
        ]
        if self.lifetime:
            argv.append(f"--lifetime={self.lifetime}")
        env = dict(os.environ)
        env.pop("TF_CONFIG", None)
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        # The directory that holds the tf_gpipe package: the workers import this very copy.
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        with open(self.log(task), "w") as log:
            return subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL, cwd=root
            )

    def start(self, tasks: Sequence[int] | None = None) -> LocalCluster:
        """Start the given tasks (default: all not running) and wait until they listen."""
        if self._closed:
            raise RuntimeError("tf_gpipe: this LocalCluster is closed; make a new one.")
        tasks = [t for t in (range(self.num_workers) if tasks is None else tasks) if not self.alive(t)]
        launched = [(t, self._launch(t)) for t in tasks]
        for t, proc in launched:
            self._procs[t] = proc
        deadline = time.monotonic() + self.startup_timeout
        try:
            for t, proc in launched:
                while WORKER_READY not in _tail(self.log(t), 10**6):
                    if proc.poll() is not None:
                        raise RuntimeError(
                            f"tf_gpipe: local worker {t} ({self.addresses[t]}) exited with code "
                            f"{proc.returncode} while starting; its log "
                            f"{self.log(t)} ends with:\n{_tail(self.log(t))}"
                        )
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"tf_gpipe: local worker {t} ({self.addresses[t]}) did not start within "
                            f"{self.startup_timeout:.0f} s; its log {self.log(t)} ends with:\n"
                            f"{_tail(self.log(t))}"
                        )
                    time.sleep(0.1)
        except BaseException:
            self.close()
            raise
        return self

    def kill(self, task: int) -> None:
        """SIGKILL one worker, as a crash would (for fault-tolerance tests)."""
        proc = self._procs[task]
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)

    def restart(self, task: int) -> None:
        """Start a fresh worker ``task`` on the same address (after a crash or ``kill``)."""
        self.kill(task)
        self.start([task])

    def close(self, grace: float = 5.0) -> None:
        """Stop every worker: SIGTERM, then SIGKILL those still alive after ``grace`` s."""
        if self._closed:
            return
        self._closed = True
        live = [p for p in self._procs if p is not None and p.poll() is None]
        for p in live:
            p.terminate()
        deadline = time.monotonic() + grace
        for p in live:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=30)
        atexit.unregister(self.close)

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"alive={[self.alive(t) for t in range(self.num_workers)]}"
        return f"LocalCluster({self.cluster_dict}, {state})"
