"""``python -m tf_gpipe.cluster --worker ...``: run one worker server (see tf_gpipe.cluster.worker)."""

import sys

from tf_gpipe.cluster.worker import worker_main

sys.exit(worker_main(sys.argv[1:]))
