"""The packages stay siblings: `encoder/` and `decoder/` never import each other; `common/`,
`encoder/`, `decoder/` and `scheduler/` never import Ray; `scheduler/` never imports torch;
`common/` imports none of the model packages; `documents/` (PDFs) imports neither torch, Ray nor
any model package. Read from the source (imports inside functions count too)."""
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
