"""The published block-FP8 format's constants, without torch: the config reader imports them
in processes that never load a model."""

BLOCK = 128  # the only block size of the published checkpoints: weights and activations
FP8_MAX = 448.0  # e4m3fn's largest finite value
