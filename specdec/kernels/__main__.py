"""Builds the kernels for this machine now (the set-up runs it): `python -m specdec.kernels`."""

from specdec.kernels import gguf_cpu

print(gguf_cpu().__file__)
