"""Builds the kernels for this machine now (the set-up runs it): `python -m specdec.runtime.kernels`."""

from specdec.runtime.kernels import cpu

print(cpu().__file__)
