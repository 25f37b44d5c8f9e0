"""Where the bundled checkpoint lives and the random seed its fresh weights start from. Both
processes name the bundled checkpoint: the service serves it, the control plane reads its
tokenizer and prompts. The control plane's port, which its clients (`met generate`) dial."""

from pathlib import Path

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "gpu_service" / "models" / "default"
DEFAULT_SEED = 0
CONTROL_PLANE_PORT = 50050
# A checkpoint's DFlash drafter, where `met train dflash` writes it and the tools look for it.
DRAFTER_DIR = "dflash"
