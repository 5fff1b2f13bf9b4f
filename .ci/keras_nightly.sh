#!/usr/bin/env bash
# Run the test suite against keras-nightly (the coming Keras release), leaving the main
# environment as it is.
#
#   .ci/keras_nightly.sh [KERAS_NIGHTLY_VERSION] [pytest arguments...]
#   .ci/keras_nightly.sh 3.16.0.dev2026102704 -x tests/test_keras_compat.py
#
# A virtual environment (.venv-keras-nightly, git-ignored) sees the packages of the main
# one (TensorFlow and the rest of requirements.txt, as .ci/run installs them) and holds
# keras-nightly alone, which shadows the pinned keras there. keras-nightly needs exactly
# the packages keras does, so it is installed without dependencies. Without a version,
# the newest keras-nightly. Where a Keras change breaks tf_gpipe, the failures name a hook
# of tf_gpipe/keras_compat/ (tests/test_keras_compat.py has one test per hook).
set -euo pipefail
cd "$(dirname "$0")/.."
version="${1:-}"
[ $# -gt 0 ] && shift
venv="${KERAS_NIGHTLY_VENV:-.venv-keras-nightly}"

python3 -m venv --system-site-packages "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --upgrade \
    "keras-nightly${version:+==$version}"
"$venv/bin/python" - <<'EOF'
import keras, tensorflow as tf
print(f"tf_gpipe against keras {keras.__version__} ({keras.__file__}), tensorflow {tf.__version__}")
assert "dev" in keras.__version__, "keras-nightly does not shadow the pinned keras in this venv"
EOF
export TF_CPP_MIN_LOG_LEVEL=2
# PYTHONPATH: the tests (and their subprocesses) import this checkout's tf_gpipe.
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$venv/bin/python" -m pytest -q -p no:cacheprovider "${@:-tests}"
