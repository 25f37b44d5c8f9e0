"""Where the tooling lives: the serving packages (`control_plane`, `gpu_service`, `kernels`,
`protos`) never import the tooling (`tools`), the training code (`training`) or the command
line (`met`), not even inside a function. `protos.met.v1` is the contract's own package, not
the command line."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVING = ("control_plane", "gpu_service", "kernels", "protos")
FORBIDDEN = ("tools", "training", "met")


def _absolute_imports(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every absolute import anywhere in `tree`; a relative import stays
    inside its package."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def offending_imports(root: Path, packages: tuple[str, ...]) -> list[str]:
    """`path:line imports module` for each import, in `packages` under `root`, of a package
    in FORBIDDEN."""
    bad = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            for line, module in _absolute_imports(ast.parse(path.read_text(), str(path))):
                if module.split(".")[0] in FORBIDDEN:
                    bad.append(f"{path.relative_to(root)}:{line} imports {module}")
    return bad


def test_the_serving_packages_import_no_tooling() -> None:
    bad = offending_imports(ROOT, SERVING)
    assert bad == [], "a serving module imports tooling:\n" + "\n".join(bad)


def test_the_check_sees_an_offending_import(tmp_path: Path) -> None:
    """The check above can fail, and names the module and the line; `protos.met.v1` passes."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text(
        "from protos.met.v1 import generate_pb2\n"
        "def f():\n"
        "    from training.checkpoint import init_model\n"
        "    import tools.bench.run, met\n"
    )
    (pkg / "b.py").write_text("from . import a\nfrom met.main import main\n")
    assert offending_imports(tmp_path, ("pkg",)) == [
        "pkg/a.py:3 imports training.checkpoint",
        "pkg/a.py:4 imports tools.bench.run",
        "pkg/a.py:4 imports met",
        "pkg/b.py:2 imports met.main",
    ]
