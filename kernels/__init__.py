"""Kernels: one folder per operator, `naive.py` (plain torch, the eager forward) beside each
kernel file."""
