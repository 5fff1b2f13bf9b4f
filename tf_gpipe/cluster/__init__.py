"""Stages on other machines: TensorFlow's own cluster runtime (gRPC servers, ClusterSpec, TF_CONFIG).

A pipeline stage on another host is just a device string such as
``"/job:worker/replica:0/task:1/device:CPU:0"``: once this process is connected to
the cluster (``connect``), TensorFlow lists the workers' devices, ``PipelineModel``
creates each stage's variables there and the schedule's ops run there; the tensors
between stages travel over TensorFlow's gRPC runtime. Nothing here moves tensors
itself. Around that:

* ``LocalCluster`` starts worker processes on 127.0.0.1 (tests, demos, benchmarks);
* ``WorkerWatch`` (``watch_workers``) turns a dead or hung worker into a clear error
  in bounded time, and ``ResumableCheckpoint`` lets the restarted script resume;
* ``ReplicatedPipeline`` runs R copies of a pipeline on disjoint devices with
  all-reduced gradients (data x pipeline parallelism).

Example:

```python
from tf_gpipe import cluster
with cluster.LocalCluster(2) as workers:        # or: export TF_CONFIG on real hosts
    cluster.connect(workers)
    model = tf_gpipe.PipelineModel(layers, devices=cluster.worker_devices(2),
                                   num_micro_batches=4)
    model.build((None, 32))
    model.compile(optimizer="adam", loss="mse")
    with cluster.watch_workers(workers) as watch:
        model.fit(x, y, epochs=2, callbacks=[watch, cluster.ResumableCheckpoint("ckpt")])
```

A worker on a real host runs ``python -m tf_gpipe.cluster --worker --task_index=K
--cluster='{"worker": ["host0:2222", "host1:2222"]}'`` (or reads ``TF_CONFIG``).
"""

from tf_gpipe.cluster.connect import client_device, connect, worker_devices
from tf_gpipe.cluster.flags import define_flags, from_flags
from tf_gpipe.cluster.local import LocalCluster
from tf_gpipe.cluster.replicated import ReplicatedPipeline
from tf_gpipe.cluster.resumable import ResumableCheckpoint
from tf_gpipe.cluster.spec import ClusterLike as ClusterLike  # the cluster argument's type
from tf_gpipe.cluster.spec import cluster_spec
from tf_gpipe.cluster.watch import WorkerFailedError, WorkerWatch, watch_workers
from tf_gpipe.cluster.worker import serve

__all__ = [
    "LocalCluster",
    "ReplicatedPipeline",
    "ResumableCheckpoint",
    "WorkerFailedError",
    "WorkerWatch",
    "client_device",
    "cluster_spec",
    "connect",
    "define_flags",
    "from_flags",
    "serve",
    "watch_workers",
    "worker_devices",
]
