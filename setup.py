"""The one thing pyproject.toml cannot say: the top-level ``data/`` and ``notebooks/``
folders travel inside the wheel as ``varbatch_kit/data`` and ``varbatch_kit/notebooks``
(found at run time by :mod:`varbatch_kit.resources`). Everything else is in pyproject.toml."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["varbatch_kit", "varbatch_kit.*"]),
              "varbatch_kit.data", "varbatch_kit.notebooks"],
    package_dir={"varbatch_kit.data": "data", "varbatch_kit.notebooks": "notebooks"},
)
