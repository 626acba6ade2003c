"""The request's path is the import graph: shared <- scheduler_svc / worker_svc / kvstore <-
gateway <- sarathi. No package imports a sibling service or a higher layer; the graph stays
acyclic. Measurement is part of the product (sarathi.measure, under sarathi); bench/ is a folder
of benchmark scripts above it all: scripts may import any product package, and no product
package imports bench (it is not installed)."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# product package -> top-level project packages it may import (besides itself)
ALLOWED = {
    "shared": set(),
    "scheduler_svc": {"shared"},
    "worker_svc": {"shared"},
    "kvstore": {"shared"},
    "gateway": {"shared"},
    "sarathi": {"shared", "scheduler_svc", "worker_svc", "kvstore", "gateway"},
}
SCRIPTS = "bench"     # benchmark scripts: may import any product package, none may import them
PROJECT = set(ALLOWED) | {SCRIPTS, "tests"}


def imported_packages(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names & PROJECT


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_lower_layers(package):
    bad = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        extra = imported_packages(path) - ALLOWED[package] - {package}
        if extra:
            bad[str(path.relative_to(ROOT))] = sorted(extra)
    assert not bad, f"imports across layers: {bad}"


def test_no_product_package_imports_bench():
    """bench/ is not installed: a product import of it would fail outside a checkout."""
    bad = sorted(str(path.relative_to(ROOT)) for package in ALLOWED
                 for path in (ROOT / package).rglob("*.py") if SCRIPTS in imported_packages(path))
    assert not bad, f"product modules importing bench: {bad}"


def test_bench_scripts_import_only_the_product_and_bench():
    bad = {}
    for path in sorted((ROOT / SCRIPTS).rglob("*.py")):
        extra = imported_packages(path) - set(ALLOWED) - {SCRIPTS}
        if extra:
            bad[str(path.relative_to(ROOT))] = sorted(extra)
    assert not bad, f"bench scripts importing tests: {bad}"


def test_allowed_graph_is_acyclic():
    """A rule change that let two packages import each other would pass the test above."""
    def reaches(a, b, seen=()):
        return any(n == b or (n not in seen and reaches(n, b, seen + (n,))) for n in ALLOWED[a])
    assert not [p for p in ALLOWED if reaches(p, p)]
