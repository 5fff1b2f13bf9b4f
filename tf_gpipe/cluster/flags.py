"""absl flags that connect a training script to a cluster (``--cluster``, ``--cluster_workers``)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import tensorflow as tf
from absl import flags

from tf_gpipe.cluster.connect import connect
from tf_gpipe.cluster.local import LocalCluster

__all__ = ["define_flags", "from_flags"]


def define_flags(flag_values: Any = None) -> None:
    """Declare ``--cluster`` and ``--cluster_workers`` (absl) for a training script."""
    fv = flags.FLAGS if flag_values is None else flag_values  # an empty FlagValues is falsy
    flags.DEFINE_string(
        "cluster",
        None,
        "Workers that hold the stages: 'host:port,host:port' or a cluster JSON "
        '({"worker": [...]}). Default: TF_CONFIG if set, else this process alone.',
        flag_values=fv,
    )
    flags.DEFINE_integer(
        "cluster_workers",
        0,
        "Start this many worker processes on 127.0.0.1 for the run (a demo of --cluster "
        "on one machine); 0: none.",
        flag_values=fv,
    )


@contextlib.contextmanager
def from_flags(flag_values: Any = None) -> Iterator[tf.train.ClusterSpec | None]:
    """Connect as ``--cluster_workers``/``--cluster``/TF_CONFIG say; yield the ClusterSpec.

    Yields None (nothing connected) when none of them is given. Local workers
    started for ``--cluster_workers`` stop when the block ends.
    """
    fv = flags.FLAGS if flag_values is None else flag_values  # an empty FlagValues is falsy
    if fv.cluster_workers:
        with LocalCluster(fv.cluster_workers) as local:
            yield connect(local)
    elif fv.cluster or os.environ.get("TF_CONFIG"):
        yield connect(fv.cluster)
    else:
        yield None
