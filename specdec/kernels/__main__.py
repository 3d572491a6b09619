"""Builds the kernels for this machine now (the set-up runs it): `python -m specdec.kernels`."""

from specdec.kernels import cpu

print(cpu().__file__)
