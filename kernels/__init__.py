"""Kernels: one folder per operator, `naive.py` (plain torch, the eager forward) beside each
Triton kernel file.

Without a CUDA device the Triton kernels run in Triton's interpreter, which must be chosen
before any kernel module imports triton."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
