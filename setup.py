"""The one compiled part of flowtrain (everything else is in pyproject.toml): an ID table's lookup and gather in C
(flowtrain/train/ids/probe.c), plain C that flowtrain.train.ids.compiled loads with ctypes. Optional: without a
compiler the install goes on and ID tables take their numpy/torch path (the same rows, slower; docs/benchmarks.md)."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("flowtrain.train.ids._probe", ["flowtrain/train/ids/probe.c"], optional=True,
                             extra_compile_args=["-O2"])])
