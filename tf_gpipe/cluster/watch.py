"""Worker failures: a dead or hung worker becomes a clear error in bounded time."""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from typing import Any

import keras
import tensorflow as tf

from tf_gpipe.cluster.local import LIVE_CLUSTERS
from tf_gpipe.cluster.spec import ClusterLike, cluster_spec, job_addresses

__all__ = ["WorkerFailedError", "WorkerWatch", "watch_workers"]


class WorkerFailedError(RuntimeError):
    """A worker holding pipeline stages died or stopped answering."""


def probe_address(address: str, timeout: float) -> str | None:
    """None if the TensorFlow server at ``address`` answers within ``timeout`` s, else why not.

    Asks the server's own ``WorkerService/GetStatus`` (a health check, not a transport):
    a crashed worker refuses the connection at once; a stopped or cut-off one never
    answers, which only a deadline can tell.
    """
    import grpc  # a TensorFlow dependency

    channel = grpc.insecure_channel(address, options=[("grpc.enable_http_proxy", 0)])
    try:
        channel.unary_unary("/tensorflow.WorkerService/GetStatus")(b"", timeout=timeout)
        return None
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return f"no answer within {timeout:g} s (the process is hung, stopped, or cut off)"
        return f"{e.code().name}: {e.details()}"
    finally:
        channel.close()


_REMOTE = re.compile(r"/job:(\w+)/replica:0/task:(\d+)")


class WorkerWatch(keras.callbacks.Callback):
    """Turn a dead or hung worker into a clear error within a bounded time.

    Use as a context manager around training (and, for ``step_timeout``, also as a
    Keras callback). A thread asks every worker's TensorFlow server for its status
    every ``probe_interval`` seconds. When a worker dies, TensorFlow itself usually
    fails the running step with ``UnavailableError`` at once; leaving the block, that
    error becomes a ``WorkerFailedError`` naming the worker and the way back. When
    a worker hangs instead (stopped process, lost host, cut network), the step waits
    inside TensorFlow's runtime, where Python cannot cancel it: once the worker has
    not answered for ``probe_timeout`` s and the block is still running ``grace`` s
    later (and still does not answer), the watch prints the same diagnosis and ends
    the process with ``exit_code`` (75, EX_TEMPFAIL: "restart me"), after stopping
    the workers of any ``LocalCluster`` this process started. ``probe_timeout``
    must exceed the time a busy worker can take to answer (its longest op).

    Args:
        cluster: as for ``connect`` (default: TF_CONFIG).
        job_name: the job whose tasks hold stages.
        probe_interval: seconds between health checks.
        probe_timeout: seconds a worker may take to answer one.
        grace: seconds the main thread gets to fail by itself; a worker that still
            does not answer then means a hang.
        step_timeout: if set, a training batch (seen through the callback) that takes
            longer counts as a hang too, even if every worker answers.
        exit_code: the process exit status after a hang; None only prints the
            diagnosis (the step may then wait forever).

    Example:

    ```python
    with cluster.watch_workers(step_timeout=600) as watch:
        model.fit(x, y, epochs=10, callbacks=[watch, resume])
    ```
    """

    def __init__(
        self,
        cluster: ClusterLike = None,
        job_name: str = "worker",
        probe_interval: float = 2.0,
        probe_timeout: float = 10.0,
        grace: float = 15.0,
        step_timeout: float | None = None,
        exit_code: int | None = 75,
    ):
        super().__init__()
        self.job_name = job_name
        self.addresses = job_addresses(cluster_spec(cluster), job_name)
        self.probe_interval, self.probe_timeout = probe_interval, probe_timeout
        self.grace, self.step_timeout, self.exit_code = grace, step_timeout, exit_code
        self.failure: str | None = None
        self._failed_at = 0.0
        self._step_started: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _name(self, task: int) -> str:
        return f"/job:{self.job_name}/replica:0/task:{task} ({self.addresses[task]})"

    def _message(self, what: str, task: int | None) -> str:
        again = (
            f"restart that worker (python -m tf_gpipe.cluster --worker --job_name={self.job_name} "
            f"--task_index={task} --cluster=... on its host)"
            if task is not None
            else "check that every worker runs and answers"
        )
        return (
            f"tf_gpipe: {what}. The pipeline cannot go on without the stages it holds. "
            f"To recover: {again}, then start this training script again; it resumes from its "
            "last checkpoint (tf_gpipe.cluster.ResumableCheckpoint or your tf.train.CheckpointManager)."
        )

    def diagnose(self) -> str | None:
        """Probe every worker now; the error message for the first that fails, else None."""
        for task in sorted(self.addresses):
            why = probe_address(self.addresses[task], self.probe_timeout)
            if why is not None:
                return self._message(f"worker {self._name(task)} stopped answering: {why}", task)
        return None

    def _run(self) -> None:
        while not self._stop.wait(self.probe_interval):
            started = self._step_started
            if self.failure is None:
                self.failure, self._failed_at = self.diagnose(), time.monotonic()
            if self.failure is None and self.step_timeout and started:
                late = time.monotonic() - started
                if late > self.step_timeout:
                    self.failure = self._message(
                        f"a training step has not finished after {late:.0f} s "
                        f"(step_timeout={self.step_timeout:g}) although every worker answers",
                        None,
                    )
                    self._abort()
            if self.failure is not None and time.monotonic() - self._failed_at >= self.grace:
                # The main thread did not fail by itself: hung. Unless the worker is back
                # (a probe lost to a busy moment), nothing will ever end the step.
                self.failure = self.diagnose()
                if self.failure is None:
                    continue
                self._abort()

    def _abort(self) -> None:
        if self._stop.is_set() or self.exit_code is None:
            if self.exit_code is None:
                sys.stderr.write(f"\n{self.failure}\n")
            return
        sys.stderr.write(
            f"\n{self.failure}\nThe step is blocked inside TensorFlow and cannot be "
            f"cancelled from Python: exiting with code {self.exit_code}.\n"
        )
        sys.stderr.flush()
        sys.stdout.flush()
        for local in list(LIVE_CLUSTERS):
            local.close(grace=1.0)
        os._exit(self.exit_code)

    def start(self) -> WorkerWatch:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="tf_gpipe-worker-watch", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.probe_timeout * (len(self.addresses) + 1))
            self._thread = None

    def __enter__(self) -> WorkerWatch:
        return self.start()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.stop()
        if not isinstance(exc, tf.errors.OpError):
            return
        failure = self.failure or self.diagnose()
        if failure is None and isinstance(exc, (tf.errors.UnavailableError, tf.errors.AbortedError)):
            tasks = [int(t) for j, t in _REMOTE.findall(str(exc)) if j == self.job_name]
            task = tasks[-1] if tasks else None
            failure = self._message(
                f"the connection to worker {self._name(task) if task is not None else '(unknown)'} "
                f"failed ({type(exc).__name__})",
                task,
            )
        if failure is not None:
            raise WorkerFailedError(failure) from exc

    # Keras callback hooks: a batch in flight is what step_timeout measures.
    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        self._step_started = time.monotonic()

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self._step_started = None


def watch_workers(cluster: ClusterLike = None, job_name: str = "worker", **kwargs: Any) -> WorkerWatch:
    """A ``WorkerWatch`` over the workers of ``cluster`` (see there for the arguments)."""
    return WorkerWatch(cluster, job_name, **kwargs)
