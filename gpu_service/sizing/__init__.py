"""The memory plan: the bytes of every part serving a model allocates, counted from shapes
before a weight loads, and whether they fit the device (`met gpu-service plan`, and `serve`'s
refusal). It builds the model, the device state and the captured graphs on the `meta` device
by the engine's own code, so it sits above the engine.

May import `gpu_service.tp`, `.model`, `.memory`, `.dflash` and `.engine`; `gpu_service.rpc`
imports it, never the reverse. This module itself stays torch-free: the service's flags read it.
"""

# `--num-slots auto` looks no further: more sequences than this at once is no decode batch.
MAX_AUTO_SLOTS = 1024
