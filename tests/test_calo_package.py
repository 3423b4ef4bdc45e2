"""The calorimeter application is a package on top of the framework: the core imports nothing
from it (issue 30.7), and the calo package's own import graph has no cycle."""
import ast
import os
import subprocess
import sys

from conftest import ENV, REPO

CORE = ["mpilearn.core.comm", "mpilearn.core.config", "mpilearn.hpo.optimize", "mpilearn.train.engine",
        "mpilearn.train.__main__", "mpilearn.train.keras_tasks", "mpilearn.train.callbacks",
        "mpilearn.train.strategies", "mpilearn.hpo.coordinator", "mpilearn.hpo.searchers",
        "mpilearn.torch", "mpilearn.keras", "mpilearn.tensorflow.keras", "mpilearn.data.hdf5",
        "mpilearn.allreduce.fusion", "mpilearn.allreduce.mpi"]


def _loaded_after(imports) -> set:
    code = ("import importlib, sys\n"
            f"for name in {imports!r}: importlib.import_module(name)\n"
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('mpilearn.'))))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO, env={**ENV, "KERAS_BACKEND": "torch"}, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return set(proc.stdout.split())


def test_the_core_loads_no_calorimeter_module():
    loaded = _loaded_after(CORE)
    assert "mpilearn.train.engine" in loaded  # the check saw the core
    assert not {m for m in loaded if m.startswith("mpilearn.calo")}


def _calo_imports(path) -> set:
    """The calo modules ``path`` imports, at the top or inside functions (relative imports)."""
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                out.add(node.module.split(".")[0])
            else:
                out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mpilearn.calo."):
            out.add(node.module.split(".")[2])
    return out


def test_the_calo_package_has_no_import_cycle():
    folder = os.path.join(REPO, "mpilearn", "calo")
    graph = {f[:-3]: _calo_imports(os.path.join(folder, f)) for f in os.listdir(folder)
             if f.endswith(".py") and f != "__init__.py"}
    assert graph["physics"] >= {"reference", "plots"}  # the parser sees lazy imports too

    def reaches(start, goal, seen=()):
        return any(n == goal or (n not in seen and reaches(n, goal, (*seen, n)))
                   for n in graph.get(start, ()))

    assert not [m for m in graph if reaches(m, m)]


def _imported_modules(path: str, package: str) -> set:
    """Absolute names of every module ``path`` (in ``package``) imports, at the top or inside
    functions, relative imports resolved."""
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            out.add(module)
            out |= {f"{module}.{a.name}" for a in node.names}
    return out


def test_no_core_module_imports_calo_even_inside_a_function():
    folder = os.path.join(REPO, "mpilearn", "core")
    found = {f: sorted(m for m in _imported_modules(os.path.join(folder, f), "mpilearn.core")
                       if m == "mpilearn.calo" or m.startswith("mpilearn.calo."))
             for f in os.listdir(folder) if f.endswith(".py")}
    assert "mpilearn.core.comm" in _imported_modules(os.path.join(REPO, "mpilearn", "calo",
                                                                  "physics.py"), "mpilearn.calo")
    assert not {f: m for f, m in found.items() if m}
