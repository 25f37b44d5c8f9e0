"""One meaning per name: no two classes share a name across the serving packages."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVING_PACKAGES = ("control_plane", "gpu_service", "kernels", "protos")


def test_no_two_classes_share_a_name_across_the_serving_packages() -> None:
    where: dict[str, list[str]] = defaultdict(list)
    for package in SERVING_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    where[node.name].append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert {name: at for name, at in where.items() if len(at) > 1} == {}
