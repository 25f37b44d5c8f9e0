"""Tensor parallelism: one model over several ranks (`met gpu-service serve --tp N`)."""
