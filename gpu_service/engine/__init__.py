"""The engine: the in-process `Model` (`facade.py`) and its parts (verifier, drafters, fused
steps, step plans, the logits pipeline, penalties, sampling, captured and compiled graphs,
measured costs), and the same engine over tensor-parallel rank processes (`ranks.py`).

May import `gpu_service.dflash`, `.memory`, `.model` and `.tp`; the memory plan and the RPC
layer import it, never the reverse."""
