# Minimal shim so that tools which still call `setup.py` work; pyproject.toml holds everything.
from setuptools import setup

setup()
