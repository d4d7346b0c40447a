"""Packages: weaver/ and, as weaver.patches, the top-level patches/ folder (every change to
vLLM outside its official hooks, kept apart and listed in patches/registry.py).
pyproject.toml holds everything else."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["weaver", "weaver.*"]), "weaver.patches"],
    package_dir={"weaver.patches": "patches"},
)
