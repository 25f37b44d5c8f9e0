"""Where the bundled checkpoint lives; torch-free, so the control plane can name it."""

from pathlib import Path

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "models" / "default"
DEFAULT_SEED = 0
