"""The attention KV's block size, without torch: the service's config reads it in processes
that never load a model."""

# Keys per block: the eager attention's reduction block, and the paged KV pool's block, so a
# block's keys are one block table entry.
KEY_BLOCK = 64
