"""The request's path is the import graph: shared <- scheduler_svc / worker_svc / kvstore <-
gateway <- sarathi. No package imports a sibling service or a higher layer; the graph stays
acyclic. Measurement is part of the product (sarathi.measure, under sarathi); bench/ is a folder
of benchmark scripts above it all: scripts may import any product package, and no product
package imports bench (it is not installed).

Inside the packages the same holds module by module: no import cycles between modules (an
import anywhere in a module counts, in a function too: it runs when called; only imports under
`if TYPE_CHECKING:` are exempt), and the modules and subpackages of one package import each
other in one direction (worker_svc.model uses worker_svc.backends, never the reverse). A
package with an entry point (worker_svc.sampling, shared.queue; worker_svc.backends below) is
used from outside through that module only."""
import ast
from collections import defaultdict
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


# -- module graph ----------------------------------------------------------------------------------
def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for package in sorted(set(ALLOWED) | {SCRIPTS})
           for path in sorted((ROOT / package).rglob("*.py")) if "results" not in path.parts}
# import cycles left to another change, each with why; a cycle among exactly these modules passes
KNOWN_CYCLES: set[frozenset[str]] = set()   # none: a cycle found is a failure


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the nodes under `if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`), not its else."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and (getattr(node.test, "id", None) == "TYPE_CHECKING"
                                         or getattr(node.test, "attr", None) == "TYPE_CHECKING"):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


def _resolve(name: str) -> str | None:
    """The deepest project module that `name` (a module or a name in one) lives in."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def module_imports(module: str) -> dict[str, int]:
    """Project module -> line of its first import in `module` (TYPE_CHECKING imports left out)."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    skip, found = _type_checking_only(tree), {}
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [_resolve(a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else _resolve(base)
                       for a in node.names]
        else:
            continue
        for target in targets:
            if target is not None and target != module:
                found[target] = min(found.get(target, node.lineno), node.lineno)
    return found


GRAPH = {m: module_imports(m) for m in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _one_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A cycle through the component's first node, as a path that ends where it starts."""
    start, inside = component[0], set(component)
    paths, seen = [[start]], {start}
    while paths:   # breadth first: the shortest way back to start
        path = paths.pop(0)
        for w in sorted(graph.get(path[-1], ())):
            if w == start:
                return path + [start]
            if w in inside and w not in seen:
                seen.add(w)
                paths.append(path + [w])
    raise AssertionError(f"no cycle in {component}")


def test_no_import_cycles_between_modules():
    """Product modules and bench scripts: a cycle is named, with the line of each import in it."""
    graph = {m: set(targets) for m, targets in GRAPH.items()}
    bad = []
    for component in _cycles(graph):
        if frozenset(component) in KNOWN_CYCLES:
            continue
        cycle = _one_cycle(graph, component)
        named = " -> ".join(f"{a}:{GRAPH[a][b]}" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[0]}"
        rest = sorted(set(component) - set(cycle))
        bad.append(named + (f" (the cycle also runs through {', '.join(rest)})" if rest else ""))
    assert not bad, "import cycles (module:line of the import):\n" + "\n".join(bad)


def test_the_modules_of_a_package_import_each_other_one_way():
    """Each module or subpackage directly inside a package counts as one node (a subpackage
    stands for everything in it); between those nodes the imports go one way."""
    packages = {m for m, path in MODULES.items() if path.name == "__init__.py"}
    bad = []
    for package in sorted(packages):
        def child(module: str) -> str | None:
            if not module.startswith(package + "."):
                return None
            return f"{package}.{module[len(package) + 1:].split('.')[0]}"

        graph: dict[str, set[str]] = defaultdict(set)
        why: dict[tuple[str, str], str] = {}
        for module, targets in GRAPH.items():
            a = child(module)
            for target, line in targets.items():
                b = child(target)
                if a is not None and b is not None and a != b:
                    graph[a].add(b)
                    why.setdefault((a, b), f"{module}:{line} imports {target}")
        for component in _cycles(graph):
            if frozenset(component) in KNOWN_CYCLES:
                continue
            cycle = _one_cycle(graph, component)
            bad.append(" -> ".join(cycle) + " (" + "; ".join(why[a, b] for a, b in zip(cycle, cycle[1:])) + ")")
    assert not bad, "modules of one package importing each other both ways:\n" + "\n".join(bad)


ENTRY_POINTS = ("worker_svc.sampling", "shared.queue")   # used from outside through this module only


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_package_with_an_entry_point_is_used_through_it(entry):
    bad = sorted(f"{m} imports {t}" for m, targets in GRAPH.items() for t in targets
                 if t.startswith(entry + ".") and not (m == entry or m.startswith(entry + "."))
                 and not m.startswith(SCRIPTS + "."))
    assert not bad, f"past {entry}'s entry point: {bad}"


def test_the_cycle_check_finds_and_names_a_cycle():
    """The checks above pass on an acyclic graph only if they can fail: a made-up graph."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _one_cycle(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_type_checking_imports_are_exempt():
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import x\nelse:\n    import y\n")
    skipped = _type_checking_only(tree)
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) and id(n) not in skipped for a in n.names}
    assert names == {"y"}

