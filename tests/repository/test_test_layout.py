"""The tests mirror the code: every test module lives in a folder named for what it tests (a
package or subpackage, `tests/processes/` for tests whose point is starting real processes,
`tests/repository/` for the repository's own rules), never loose in `tests/`; and the slow tier
is marked where the tests live (`pytest.mark.slow`), never listed by test id in a conftest."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
PACKAGES = ("control_plane", "gpu_service", "kernels", "protos", "training", "tools", "met")
FOLDERS = (*PACKAGES, "processes", "repository")
# A string that names a test: a node id, or a test module's file.
TEST_ID = re.compile(r"::|(^|/)test_\w*\.py\b")


def _test_modules() -> list[Path]:
    """What pytest collects by its default `python_files`."""
    return sorted({*TESTS.rglob("test_*.py"), *TESTS.rglob("*_test.py")})


def test_no_test_module_sits_directly_in_tests() -> None:
    loose = [p.name for p in _test_modules() if p.parent == TESTS]
    assert loose == [], f"move {loose} into the folder of what they test"


def test_every_test_module_is_in_a_mirror_folder() -> None:
    astray = [
        str(p.relative_to(TESTS))
        for p in _test_modules()
        if p.relative_to(TESTS).parts[0] not in FOLDERS
    ]
    assert astray == [], f"{astray} are outside tests/{{{','.join(FOLDERS)}}}/"


def test_a_package_folder_is_a_package_of_the_code() -> None:
    """tests/control_plane/scheduler/ holds the tests of control_plane/scheduler/, which exists."""
    folders = {p.parent.relative_to(TESTS) for p in _test_modules()}
    missing = [
        str(f) for f in sorted(folders) if f.parts[0] in PACKAGES and not (ROOT / f).is_dir()
    ]
    assert missing == [], f"tests/{missing} mirror no folder of the code"


def test_every_test_folder_is_a_package() -> None:
    """Same-named modules in different folders (scheduler/test_step.py, gpu_service/test_step.py)
    import as different modules only inside packages."""
    folders = {p.parent for p in _test_modules()}
    for folder in list(folders):
        folders.update(a for a in folder.parents if a.is_relative_to(TESTS))
    bare = [str(f.relative_to(ROOT)) for f in sorted(folders) if not (f / "__init__.py").is_file()]
    assert bare == [], f"{bare} have no __init__.py"


def test_no_conftest_names_tests() -> None:
    """The slow tier (and anything else) is marked in the test modules: a conftest names
    fixtures, never test ids or test modules."""
    for conftest in sorted(TESTS.rglob("conftest.py")):
        tree = ast.parse(conftest.read_text())
        named = [
            node.value
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and TEST_ID.search(node.value)
        ]
        assert named == [], f"{conftest.relative_to(ROOT)} names tests: {named}"
