"""tf_gpipe: GPipe pipeline parallelism for TensorFlow 2 and Keras 3."""

from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="tf_gpipe",
    version="0.1.0",
    description="GPipe pipeline parallelism for TensorFlow 2 and Keras 3",
    long_description=Path("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["tf_gpipe", "tf_gpipe.*"]),
    python_requires=">=3.10",
    # Tested with tensorflow 2.21.0, keras 3.15.1, numpy 2.4, absl-py 2.5 (Python 3.11); the
    # whole suite also passes on keras-nightly 3.16.0.dev2026102704 (.ci/keras_nightly.sh).
    # Private Keras APIs (tf_gpipe/keras_compat/) may move in any release: keep keras < 3.17
    # until a newer one is tested.
    install_requires=[
        "tensorflow>=2.21,<2.22",
        "keras>=3.15,<3.17",
        "numpy>=1.26,<3",
        "absl-py>=2.1,<3",
    ],
    extras_require={
        "test": ["pytest>=8,<10", "pytest-xdist>=3.5,<4", "hypothesis>=6.100,<7"],
        "bench": ["matplotlib>=3.8,<4"],
        "dev": ["ruff==0.17.6", "mypy==2.4.1"],  # as requirements-dev.txt
    },
)
