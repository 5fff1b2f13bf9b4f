"""A worker process: one TensorFlow server that can hold stages (``python -m tf_gpipe.cluster``)."""

from __future__ import annotations

import argparse
import os
import threading
import time
from collections.abc import Sequence

import tensorflow as tf

from tf_gpipe.cluster.local import WORKER_READY
from tf_gpipe.cluster.spec import ClusterLike, cluster_spec, parse_cluster

__all__ = ["serve"]


def _exit_when_orphaned(parent_pid: int, lifetime: float | None) -> None:
    end = None if not lifetime else time.monotonic() + lifetime
    while True:
        if parent_pid and os.getppid() != parent_pid:
            os._exit(0)  # the launcher is gone: nobody will stop us
        if end is not None and time.monotonic() > end:
            os._exit(0)
        time.sleep(0.5)


def serve(
    cluster: ClusterLike,
    job_name: str = "worker",
    task_index: int = 0,
    protocol: str = "grpc",
    virtual_cpus: int = 1,
    threads: int = 0,
) -> tf.distribute.Server:
    """Start this process's ``tf.distribute.Server`` for task ``task_index`` of ``job_name``."""
    config = tf.compat.v1.ConfigProto(
        device_count={"CPU": virtual_cpus},
        intra_op_parallelism_threads=threads,
        inter_op_parallelism_threads=threads,
    )
    return tf.distribute.Server(
        cluster_spec(cluster),
        job_name=job_name,
        task_index=task_index,
        protocol=protocol,
        config=config,
        start=True,
    )


def worker_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tf_gpipe.cluster",
        description="Run one TensorFlow worker server that can hold tf_gpipe stages.",
    )
    parser.add_argument("--worker", action="store_true", required=True, help="run a worker server")
    parser.add_argument("--cluster", default=None, help="cluster JSON or host:port,... (default: TF_CONFIG)")
    parser.add_argument("--job_name", default=None, help="default: TF_CONFIG task type, else 'worker'")
    parser.add_argument("--task_index", type=int, default=None, help="default: TF_CONFIG task index")
    parser.add_argument("--protocol", default="grpc")
    parser.add_argument("--virtual_cpus", type=int, default=1, help="logical CPU devices to expose")
    parser.add_argument("--threads", type=int, default=0, help="intra/inter-op threads (0: default)")
    parser.add_argument("--parent_pid", type=int, default=0, help="exit when this parent process is gone")
    parser.add_argument("--lifetime", type=float, default=0, help="exit after this many seconds (0: never)")
    args = parser.parse_args(argv)
    _, task = parse_cluster(args.cluster)
    job = args.job_name or (task or {}).get("type") or "worker"
    index = args.task_index if args.task_index is not None else int((task or {}).get("index", 0))
    server = serve(args.cluster, job, index, args.protocol, args.virtual_cpus, args.threads)
    threading.Thread(target=_exit_when_orphaned, args=(args.parent_pid, args.lifetime), daemon=True).start()
    print(f"{WORKER_READY} /job:{job}/replica:0/task:{index} {server.target} pid={os.getpid()}", flush=True)
    server.join()
    return 0
