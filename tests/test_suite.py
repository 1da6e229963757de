"""The suite's own rules: a test module imports helper modules (tests/conftest.py, tests/standins.py,
tests/manifests.py, tests/serving.py, tests/fakes/), never another test module, so each test file
can be moved, split or deleted without breaking another."""

from __future__ import annotations

import ast
import re

from tests.conftest import REPO

TEST_MODULE = re.compile(r"test_\w+")


def imported_test_modules(source: str) -> list[tuple[int, str]]:
    """(line, module) for every import of a test module, at any level (in functions too)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if any(TEST_MODULE.fullmatch(part) for part in name.split(".")):
                found.append((node.lineno, name))
                break
    return sorted(found)


def test_no_test_module_imports_another():
    offenders = [f"{path.relative_to(REPO)}:{line}: imports {name}"
                 for path in sorted((REPO / "tests").rglob("*.py"))
                 for line, name in imported_test_modules(path.read_text())]
    assert not offenders, "move shared helpers into a helper module:\n" + "\n".join(offenders)


def test_the_check_sees_every_form_of_import():
    source = ("import tests.test_e2e\nfrom tests.test_remote import add_entry\nfrom tests import test_targets\n"
              "def f():\n    from test_e2e import assert_warm\nfrom .test_x import y\n"
              "from tests import manifests\nfrom tests.standins import add_entry\nimport pytest\n")
    assert [line for line, _ in imported_test_modules(source)] == [1, 2, 3, 5, 6]
