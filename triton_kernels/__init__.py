"""Triton kernels and their launchers (no autograd), one file per op; installed as seqpar.triton_kernels."""
