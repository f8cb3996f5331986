"""Triton kernels and their launchers. Imports nothing from coordinator/."""
