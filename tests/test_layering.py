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


BACKENDS = ROOT / "worker_svc" / "backends"
# device code: native libraries (ctypes), FlashInfer, CUDA
DEVICE_MODULES = ("ctypes", "flashinfer", "torch.cuda")


def device_code(path: Path) -> list[str]:
    """What `path` uses of device code: imports of DEVICE_MODULES (or their submodules), any
    torch.cuda attribute, and imports of a submodule of worker_svc.backends (its cpu/ and cuda/
    backends, its base and torch attention): outside the package only what
    worker_svc.backends itself exports may be used."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "torch":
            names = [f"torch.{node.attr}"]
        else:
            continue
        found += [n for n in names if any(n == m or n.startswith(m + ".") for m in DEVICE_MODULES)
                  or _backend_submodule(n)]
    return found


def _backend_submodule(name: str) -> bool:
    """worker_svc.backends.X[...] where X is a module or package of worker_svc/backends/."""
    parts = name.split(".")
    return (parts[:2] == ["worker_svc", "backends"] and len(parts) > 2
            and ((BACKENDS / parts[2]).is_dir() or (BACKENDS / f"{parts[2]}.py").is_file()))


def test_device_code_lives_only_under_worker_svc_backends():
    """Every product package but bench (which measures the kernels themselves): no ctypes, no
    flashinfer, no torch.cuda, and no backend internals outside worker_svc/backends/; there a
    device is a backend, not `if cuda` branches in the model or the model runner."""
    bad = {}
    for package in sorted(set(ALLOWED) - {"bench"}):
        for path in sorted((ROOT / package).rglob("*.py")):
            if BACKENDS not in path.parents and (found := device_code(path)):
                bad[str(path.relative_to(ROOT))] = sorted(set(found))
    assert not bad, f"device code outside worker_svc/backends/: {bad}"
