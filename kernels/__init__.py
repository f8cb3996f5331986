"""Kernels and their launchers: Triton (CUDA) and numba (CPU), one file per
concern and family, all reading :mod:`kvhit.kernels.contract`. Imports nothing
from coordinator/; importing this package imports neither triton nor numba."""
