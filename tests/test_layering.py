"""The packages stay siblings: `encoder/` and `decoder/` never import each other; `common/`,
`encoder/`, `decoder/` and `scheduler/` never import Ray; `scheduler/` never imports torch;
`common/` imports none of the model packages; `documents/` (PDFs) imports neither torch, Ray nor
any model package. Read from the source (imports inside functions count too). No module of these
packages imports itself through others (an import circle: it works or not by import order)."""
import ast
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORBIDDEN = {
    "common": {"encoder", "decoder", "scheduler", "deployments", "ray"},
    "encoder": {"decoder", "deployments", "ray"},
    "decoder": {"encoder", "scheduler", "deployments", "ray"},
    "scheduler": {"encoder", "decoder", "deployments", "ray", "torch"},
    "documents": {"torch", "ray", "encoder", "decoder", "scheduler", "deployments"},
}
PACKAGES = ("common", "encoder", "decoder", "scheduler", "deployments", "documents", "corpus")


def imported_roots(package: str) -> dict[str, set[str]]:
    """Top-level modules each file of `package` imports (relative imports resolve inside it)."""
    found = {}
    for directory, _, files in os.walk(os.path.join(ROOT, package)):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(directory, name)
            roots = set()
            for node in ast.walk(ast.parse(open(path).read(), path)):
                if isinstance(node, ast.Import):
                    roots |= {alias.name.split(".")[0] for alias in node.names}
                elif isinstance(node, ast.ImportFrom):
                    roots.add(package if node.level else node.module.split(".")[0])
            found[os.path.relpath(path, ROOT)] = roots
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_stay_in_their_layer(package):
    files = imported_roots(package)
    assert files, f"no Python files under {package}/"
    bad = {path: sorted(roots & FORBIDDEN[package]) for path, roots in files.items()
           if roots & FORBIDDEN[package]}
    assert not bad, f"{package}/ imports what it must not: {bad}"


def test_the_check_sees_a_forbidden_import(tmp_path, monkeypatch):
    """The checker itself can fail: a planted `from decoder import x` under encoder/ is found."""
    (tmp_path / "encoder").mkdir()
    (tmp_path / "encoder" / "bad.py").write_text("def f():\n    from decoder.model import Decoder\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    assert imported_roots("encoder") == {os.path.join("encoder", "bad.py"): {"decoder"}}


def import_graph(packages=PACKAGES) -> dict[str, set[str]]:
    """Module -> the modules of `packages` it imports, read from the source: `import a.b`,
    `from a.b import c` (c a module: a.b.c, else a.b), relative imports resolved, imports inside
    functions included. A package is its `__init__`; a module's own package is not an edge
    (importing `p.m` runs `p/__init__` first, which imports what it imports anyway)."""
    files = {}
    for package in packages:
        for directory, _, names in os.walk(os.path.join(ROOT, package)):
            for name in names:
                if name.endswith(".py"):
                    path = os.path.join(directory, name)
                    parts = os.path.relpath(path, ROOT)[:-3].split(os.sep)
                    files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for module, path in files.items():
        is_package = path.endswith("__init__.py")
        edges = set()
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    here = module.split(".") if is_package else module.split(".")[:-1]
                    here = here[:len(here) - node.level + 1]
                    base = ".".join(here + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base
                           for alias in node.names]
            else:
                continue
            for target in targets:  # the longest name of ours: `a.b.func` is a.b
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target:
                    edges.add(target)
        edges.discard(module)
        graph[module] = edges
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of `graph`: each group of modules that reach each other (Tarjan's
    strongly connected components with more than one module), sorted."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
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
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


def test_no_import_circles():
    graph = import_graph()
    assert {"decoder.kv_cache", "encoder.preprocess", "deployments.router"} <= set(graph)
    assert not import_cycles(graph), f"modules that import each other: {import_cycles(graph)}"


def test_the_cycle_check_sees_a_lazy_circle(tmp_path, monkeypatch):
    """The checker itself can fail: a cache that imports its kernel inside a method while the
    kernel imports the cache's constant (decoder/kv_cache.py's old circle) is found, as is one
    through a relative `from . import`; a package importing its own modules is no circle."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("from .cache import Cache\n")
    (tmp_path / "pkg" / "cache.py").write_text(
        "PAGE = 64\n\nclass Cache:\n    def attend(self):\n        from .kernel import run\n")
    (tmp_path / "pkg" / "kernel.py").write_text("from pkg.cache import PAGE\n")
    (tmp_path / "pkg" / "a.py").write_text("from . import b\n")
    (tmp_path / "pkg" / "b.py").write_text("def f():\n    import pkg.a\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    graph = import_graph(("pkg",))
    assert graph["pkg"] == {"pkg.cache"}
    assert import_cycles(graph) == [["pkg.a", "pkg.b"], ["pkg.cache", "pkg.kernel"]]


def test_importing_the_router_leaves_the_encoder_class_its_own():
    """`serve.ingress` pickles the Router when its module is imported, and what the Router's code
    names travels with it. A class cloudpickle cannot find by name (a class under a
    `@serve.deployment` decorator, whose module name is the Deployment) goes by value, and
    unpickling it in the same process rewrites the original's methods with copies whose globals
    are not their module's: a test's monkeypatch of the module then no longer reached the
    encoder's decode (fixed by the Router naming the plain `EncoderReplica`). In a fresh process,
    so that nothing is imported before."""
    import subprocess
    code = ("import deployments.router\nfrom deployments import encoders\n"
            "assert encoders.PathEncoder.func_or_class is encoders.EncoderReplica\n"
            "assert encoders.EncoderReplica._arrive.__globals__ is encoders.__dict__\nprint('own')")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    assert run.returncode == 0 and "own" in run.stdout, run.stderr[-2000:]
