"""How the packages depend on each other: the control plane and the shared contract never load
torch, the service never imports the control plane and the control plane reaches the service
only through the contract (`protos`), the service's floors import only floors below their own,
no module of the seven packages is in an import cycle (counting imports inside functions), and
no function outside the tests and the kernels runs past 60 lines."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("control_plane", "gpu_service", "kernels", "protos", "training", "tools", "met")
MAX_FUNCTION_LINES = 60
# The GPU service's floors, lowest first: a module imports its own floor and those below it,
# never one above (the model computes on the device state and never asks the engine; the
# memory plan counts what the engine builds; the RPC layer drives them all).
SERVICE_FLOORS = ("tp", "model", "memory", "dflash", "engine", "sizing", "rpc")


def _modules(package: str) -> dict[str, Path]:
    """Module name -> file, generated protobuf stubs left out."""
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path) -> set[str]:
    """Modules `name` imports anywhere: at module level, under `TYPE_CHECKING`, and inside
    functions (which run later, but are a dependency all the same)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return found


def test_the_control_plane_and_the_contract_never_load_torch() -> None:
    names = [*_modules("control_plane"), *_modules("protos")]
    script = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "print('torch' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False", "a control-plane or protos module imports torch"


def test_the_service_never_imports_the_control_plane() -> None:
    for name, path in {**_modules("gpu_service"), **_modules("kernels")}.items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("control_"):
                raise AssertionError(f"{name} imports {node.module}")
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("control_") for a in node.names), name


def test_the_control_plane_reaches_the_service_only_through_the_contract() -> None:
    """The control plane imports no `gpu_service` module: what it needs of the service is in
    `protos` (an in-process engine comes from `met`, as `protos.model.OpenModel`)."""
    reached = [
        f"{name} imports {imported}"
        for name, path in _modules("control_plane").items()
        for imported in sorted(_imports(name, path))
        if imported.split(".")[0] == "gpu_service"
    ]
    assert reached == []


def _floor(module: str) -> str:
    """`gpu_service.engine.facade` -> `engine`."""
    return module.split(".")[1] if module.count(".") else ""


def upward_imports(modules: dict[str, Path]) -> list[str]:
    """Each import of a `gpu_service` module from a floor below the imported one's."""
    rank = {floor: i for i, floor in enumerate(SERVICE_FLOORS)}
    return [
        f"{name} ({_floor(name)}) imports {imported} ({_floor(imported)})"
        for name, path in modules.items()
        for imported in sorted(_imports(name, path))
        if imported.startswith("gpu_service.")
        and _floor(imported) in rank
        and rank[_floor(imported)] > rank[_floor(name)]
    ]


def test_every_service_module_sits_on_a_floor() -> None:
    astray = [
        n for n in _modules("gpu_service") if n != "gpu_service" and _floor(n) not in SERVICE_FLOORS
    ]
    assert astray == [], f"add their package to SERVICE_FLOORS, in its place: {astray}"


def test_no_service_floor_imports_a_higher_one() -> None:
    assert upward_imports(_modules("gpu_service")) == []


def test_the_floor_check_sees_an_upward_import(tmp_path: Path) -> None:
    """The check above can fail: the model importing the engine, even inside a function, is
    reported; the engine importing the model is not."""
    low, high = tmp_path / "low.py", tmp_path / "high.py"
    low.write_text("def f():\n    from gpu_service.engine.facade import Engine\n")
    high.write_text("from gpu_service.model.state import DeviceState\n")
    found = upward_imports({"gpu_service.model.x": low, "gpu_service.engine.y": high})
    assert found == [
        "gpu_service.model.x (model) imports gpu_service.engine.facade (engine)",
        "gpu_service.model.x (model) imports gpu_service.engine.facade.Engine (engine)",
    ]


def test_no_import_cycle() -> None:
    modules = {n: p for pkg in PACKAGES for n, p in _modules(pkg).items()}
    graph = {n: sorted(_imports(n, p) & modules.keys() - {n}) for n, p in modules.items()}
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(node) :] + [node]))
        if node in done:
            return
        for nxt in graph[node]:
            if not node.startswith(nxt + "."):  # a package's own __init__ is not a cycle
                visit(nxt, [*path, node])
        done.add(node)

    for name in graph:
        visit(name, [])


def test_the_cycle_finder_sees_a_cycle(tmp_path: Path) -> None:
    """The check above can fail: two modules importing each other are reported, an import
    inside a function or under `TYPE_CHECKING` as much as one at module level."""
    (tmp_path / "a.py").write_text("from pkg import b\n")
    (tmp_path / "b.py").write_text("def f():\n    import pkg.a\n")
    (tmp_path / "c.py").write_text("if TYPE_CHECKING:\n    from pkg.a import x\n")
    assert "pkg.b" in _imports("pkg.a", tmp_path / "a.py")
    assert "pkg.a" in _imports("pkg.b", tmp_path / "b.py")
    assert "pkg.a" in _imports("pkg.c", tmp_path / "c.py")


def test_no_function_runs_past_60_lines() -> None:
    long = []
    for package in ("control_plane", "gpu_service", "protos", "training", "tools", "met"):
        for name, path in _modules(package).items():
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    lines = (node.end_lineno or node.lineno) - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        long.append(f"{name}.{node.name}: {lines} lines")
    assert long == []
