"""What travels with an MPIJob from the checkout: a model file (``model: path.py[:function]``)
and the modules it imports from outside the image's environment, as ConfigMap entries
mounted at /etc/mpilearn in every pod (the launcher runs with ``--set model=...`` pointing
there). A model given as a module is the image's; a file on a pod volume stays there.
"""
from __future__ import annotations

import os
import re
import sys

from ..errors import UsageError

CONFIG_DIR = "/etc/mpilearn"   # the ConfigMap's mount (the operator's own is /etc/mpi)


def model_file(config: dict) -> str:
    """The model's file when the config names one (``path.py[:function]``), else ""."""
    target = config.get("model", "").partition(":")[0]
    return target if target.endswith(".py") or os.sep in target else ""


def on_volume(path: str, kube: dict) -> bool:
    """An absolute path the pods see on the data or runs volume."""
    workdir = kube["workdir"].rstrip("/")
    path = os.path.normpath(path)
    return any(path.startswith(f"{workdir}/{v}/") for v in ("data", "runs"))


def _user_modules() -> dict:
    """name -> file of the imported modules that are not the environment's (the standard
    library, site-packages, the mpilearn package): what an image built from mpilearn lacks."""
    import site

    import mpilearn

    env = tuple(os.path.join(os.path.realpath(p), "") for p in
                {sys.prefix, sys.base_prefix, sys.exec_prefix, *site.getsitepackages()})
    package = os.path.join(os.path.dirname(os.path.abspath(mpilearn.__file__)), "")
    out = {}
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if (path and path.endswith(".py") and not os.path.realpath(path).startswith(env)
                and not os.path.abspath(path).startswith(package)):
            out[name] = os.path.abspath(path)
    return out


def model_modules(spec: str) -> list:
    """The model file and every module it imports (directly or not) from outside the
    environment, found by importing it afresh (those imported before are set aside, then
    put back)."""
    from ..core.builders import load_builder

    aside = {name: sys.modules.pop(name) for name in _user_modules()}
    try:
        load_builder(spec)
        found = _user_modules()
    finally:
        for name in _user_modules():
            sys.modules.pop(name, None)
        sys.modules.update(aside)
    return sorted(set(found.values()))


def carried_model(config: dict, kube: dict) -> tuple:
    """({ConfigMap key: file text}, the model's key, the --set that points the run at it) for
    a model file from the checkout, with the modules it imports from outside the image's
    environment (they land beside it in /etc/mpilearn, which its folder's sys.path entry
    finds); () for a module (the image's) or a file on a pod volume."""
    path = model_file(config)
    if not path or (os.path.isabs(path) and on_volume(path, kube)):
        return ()
    files = {}
    for p in [os.path.abspath(path)] + model_modules(config["model"]):
        key = os.path.basename(p)
        if not re.fullmatch(r"[-._a-zA-Z0-9]+", key) or key == "config.yaml":
            raise UsageError(f"model {path}: {p}'s file name cannot be a ConfigMap key; rename "
                             "it (letters, digits, '-', '_', '.')")
        if key in files and files[key] != open(p).read():
            raise UsageError(f"model {path}: two modules it imports are named {key}; they would "
                             "land in one folder in the pods: rename one")
        with open(p) as f:
            files[key] = f.read()
    key = os.path.basename(path)
    function = config["model"].partition(":")[2]
    return files, key, f"model={CONFIG_DIR}/{key}" + (f":{function}" if function else "")
