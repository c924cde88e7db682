"""The package list pyproject.toml cannot express: every ``trainer3d*`` package, plus conf/
(Hydra's config groups, *.yaml only) shipped inside the package as ``trainer3d.conf``, so an
installed ``trainer3d`` command finds its configs without a checkout (trainer3d/train.py CONF_DIR).
Everything else is in pyproject.toml."""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["trainer3d*"]), "trainer3d.conf"],
      package_dir={"trainer3d.conf": "conf"},
      package_data={"trainer3d.conf": ["*.yaml", "*/*.yaml"]})
