"""The DFlash block drafter: a few Qwen3 decoder layers that read the target's embedding and LM
head and the concatenated outputs of some of its layers (`target_layer_ids`), and propose a
block of drafts in one non-causal forward.

- `config.py`: a drafter's `config.json` in z-lab's published layout, checked against the target.
- `weights.py`: its tensors, by name and shape, refused when any is unknown or missing.
- `naive.py`: the published algorithm in plain torch, the reference the engine and the
  training forward are held to.

- `model.py`: its batched forward over the target's ops, its context in the engine's paged pool.

May import `gpu_service.model` (the target's config, ops and device state), the floors below
it and torch; the engine's parts and the memory plan import it, never the reverse."""
