"""The package's shape (issue 34.3): no import cycle anywhere, every public entry point and
Horovod-shaped import loads, and the package top holds only entry points and the one core
module that belongs there."""
import ast
import os
import subprocess
import sys
import tomllib

from conftest import ENV, REPO

PACKAGE = os.path.join(REPO, "mpilearn")


def _modules(root: str) -> dict:
    """Dotted name -> file, for every module under ``root``/mpilearn-like package folder."""
    out = {}
    base = os.path.dirname(root)
    for folder, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                parts = os.path.relpath(os.path.join(folder, f), base)[:-3].split(os.sep)
                out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = \
                    os.path.join(folder, f)
    return out


def _targets(name: str, path: str, node, modules: dict) -> list:
    """The package modules one import statement loads (relative imports resolved;
    ``from pkg import sub`` is the submodule, ``from pkg import name`` is pkg itself)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in modules]
    if node.level:
        here = name.split(".") if path.endswith("__init__.py") else name.split(".")[:-1]
        anchor = here[:len(here) - (node.level - 1)]
        target = ".".join(anchor + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    out = []
    for alias in node.names:
        sub = f"{target}.{alias.name}"
        if sub in modules:
            out.append(sub)
        elif target in modules:
            out.append(target)
    return out


def import_graph(root: str) -> dict:
    """Module -> {module it imports: line}, for imports at the top and inside functions. An
    import of ``a.b.c`` also runs ``a.b``'s ``__init__`` (an edge to it, unless it is the
    importer's own package, which Python has always loaded first)."""
    modules = _modules(root)
    graph = {}
    for name, path in modules.items():
        edges = {}
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _targets(name, path, node, modules):
                parts = target.split(".")
                for i in range(2, len(parts) + 1):
                    dep = ".".join(parts[:i])
                    if dep != name and not name.startswith(dep + ".") and dep in modules:
                        edges.setdefault(dep, node.lineno)
        graph[name] = edges
    return graph


def cycles(graph: dict) -> list:
    """Each import cycle as a path ``a:line -> b:line -> ... -> a`` (one per strongly
    connected group of modules)."""
    found, done = [], set()

    def walk(node, path):
        for nxt, line in sorted(graph[node].items()):
            if nxt in path:
                loop = path[path.index(nxt):] + [nxt]
                if not set(loop) & done:
                    found.append(" -> ".join(f"{a} (line {graph[a][b]})"
                                             for a, b in zip(loop, loop[1:])) + f" -> {nxt}")
                    done.update(loop)
            elif nxt not in visited:
                visited.add(nxt)
                walk(nxt, path + [nxt])

    for start in sorted(graph):
        visited = {start}
        walk(start, [start])
    return found


def test_the_cycle_finder_sees_top_level_function_level_and_relative_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import g\n")
    (pkg / "c.py").write_text("import pkg.a\ng = 1\n")
    found = cycles(import_graph(str(pkg)))
    assert len(found) == 1 and all(m in found[0] for m in ("pkg.a", "pkg.sub.b", "pkg.c")), found
    (pkg / "c.py").write_text("g = 1\n")
    assert cycles(import_graph(str(pkg))) == []


def test_the_package_has_no_import_cycle():
    graph = import_graph(PACKAGE)
    # the parser sees lazy imports and the package __init__ they run
    assert "mpilearn.cluster.allocation" in graph["mpilearn.cluster.jobs"]
    assert "mpilearn.torch" in graph["mpilearn.keras.optimizer"]
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(found)


# python -m mpilearn.X for each X, and the Horovod-shaped imports (import mpilearn.torch as hvd)
ENTRY_POINTS = ["train", "train.__main__", "optimize", "jobs", "generate", "validate", "export",
                "simulate", "refit", "report", "run"]
HOROVOD = {"torch": "horovod.torch", "tensorflow": "horovod.tensorflow",
           "tensorflow.keras": "horovod.tensorflow.keras", "keras": "horovod.keras"}


def test_every_entry_point_and_horovod_shaped_import_loads():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    assert "mpilearn-run" in scripts and "mpilearn-train" in scripts
    # one interpreter for all of them: TensorFlow starts once
    code = f"""
import importlib
for name in {[f"mpilearn.{m}" for m in ENTRY_POINTS if m != "train"]!r}:
    assert callable(importlib.import_module(name).main), name
importlib.import_module("mpilearn.train")
for script, target in {scripts!r}.items():
    module, attr = target.split(":")
    assert callable(getattr(importlib.import_module(module), attr)), script
for name in {[f"mpilearn.{m}" for m in HOROVOD]!r}:
    hvd = importlib.import_module(name)
    for api in ("init", "rank", "size", "allreduce", "broadcast", "DistributedOptimizer"):
        assert callable(getattr(hvd, api)), (name, api)
print("loaded")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO, env={**ENV, "KERAS_BACKEND": "tensorflow"}, timeout=300)
    assert proc.returncode == 0 and "loaded" in proc.stdout, proc.stderr[-3000:]


# the one-line shims that keep python -m mpilearn.X short; the code lives in a subpackage
ENTRY_SHIMS = {"export", "generate", "jobs", "optimize", "refit", "report", "run", "simulate",
               "validate"}
# errors.py: the exceptions and the exception -> exit status table that every subpackage
# (core, cluster, hpo, train, calo, allreduce) and every main() imports; it imports nothing of
# the package at its top, so it sits below all of them, and mpilearn.errors is the public name
# user code catches (UsageError, TrainingStopped)
CORE_AT_TOP = {"errors"}


def test_the_package_top_holds_only_init_entry_points_and_errors():
    """``mpilearn/`` holds ``__init__.py``, the entry shims (each only imports its ``main``
    from a subpackage) and ``errors.py``; every concern has its folder (core/, cluster/,
    hpo/, train/, calo/, ...)."""
    modules = {f[:-3] for f in os.listdir(PACKAGE) if f.endswith(".py")}
    assert modules == {"__init__"} | ENTRY_SHIMS | CORE_AT_TOP, modules
    for name in ENTRY_SHIMS:
        tree = ast.parse(open(os.path.join(PACKAGE, f"{name}.py")).read())
        froms = [n for n in tree.body if isinstance(n, ast.ImportFrom)]
        assert len(froms) == 1 and froms[0].level == 1 and \
            [a.name for a in froms[0].names] == ["main"], name
        defs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.Assign))]
        assert not defs, f"mpilearn/{name}.py holds code; move it beside what it drives"


def test_the_package_says_the_version_pyproject_gives():
    import mpilearn

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        assert mpilearn.__version__ == tomllib.load(f)["project"]["version"]
