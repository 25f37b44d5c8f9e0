"""Generate the Python stubs of every .proto under protos/: `python -m protos.generate`."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent


def proto_files() -> list[Path]:
    return sorted(ROOT.rglob("*.proto"))


def generate(out: Path) -> None:
    """Write *_pb2.py, *_pb2.pyi and *_pb2_grpc.py for every proto into `out` (same tree)."""
    protos = [str(p.relative_to(ROOT)) for p in proto_files()]
    include = str(Path(protoc.__file__).parent / "_proto")
    args = [
        "protoc",
        f"-I{ROOT}",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    for stub in out.rglob("*_pb2_grpc.py"):
        # The stubs import their messages as a top-level `met` package; ours lives in `protos`.
        text = re.sub(
            r"^from met\.v1 import", "from protos.met.v1 import", stub.read_text(), flags=re.M
        )
        stub.write_text(text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT, help="output root (default: in place)")
    generate(parser.parse_args(argv).out)


if __name__ == "__main__":
    main(sys.argv[1:])
