"""Pages generated from the code at build time, so that they cannot drift from it:

- ``reference/config.md``: every config key (training and search) with its default and meaning,
  from ``mpilearn.core.config`` (``SCHEMA``, ``SEARCH``, ``DESCRIPTIONS``, ``CHOICES``): the
  source ``python -m mpilearn.train --help`` and the unknown-key check read too. A key without
  a description is a build warning (an error under ``-W``);
- ``reference/cli.md``: every command's ``--help``, as the command prints it.

Both are written into the source tree before Sphinx reads it (and only when they change, so
an unchanged build stays incremental); they are not tracked (docs/.gitignore).
"""
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from sphinx.util import logging

LOG = logging.getLogger(__name__)

# (what a user types, the module that answers --help)
COMMANDS = [
    ("python -m mpilearn.train", "mpilearn.train"),
    ("mpilearn-run", "mpilearn.run"),
    ("python -m mpilearn.optimize", "mpilearn.optimize"),
    ("python -m mpilearn.refit", "mpilearn.refit"),
    ("python -m mpilearn.report", "mpilearn.report"),
    ("python -m mpilearn.jobs", "mpilearn.jobs"),
    ("python -m mpilearn.simulate", "mpilearn.simulate"),
    ("python -m mpilearn.validate", "mpilearn.validate"),
    ("python -m mpilearn.generate", "mpilearn.generate"),
    ("python -m mpilearn.export", "mpilearn.export"),
    ("python -m mpilearn.data.toy", "mpilearn.data.toy"),
]

SECTIONS = [
    ("", "The model and its hyperparameters, the run directory", ("model", "hparams", "output")),
    ("data", "Data", ("data.",)),
    ("train", "Training", ("train.",)),
    ("device", "Devices", ("device.",)),
    ("search", "Hyperparameter search", ("search.",)),
]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def config_page() -> str:
    from mpilearn.core import config

    keys = list(config.documented_keys())
    described = set()
    lines = ["# Config keys", "",
             "Generated from `mpilearn/core/config.py` (`SCHEMA`, `SEARCH`, `DESCRIPTIONS`): the "
             "one source that `python -m mpilearn.train --help`, `python -m mpilearn.optimize "
             "--help` and the unknown-key check also read. A config is one YAML file; "
             "`--set key=value` overrides any key (the value parses as YAML); an unknown key "
             "is an error that names it and suggests the nearest valid one. How the keys work "
             "together: [Training from the command line](../guide/train.md).", ""]
    for section, title, prefixes in SECTIONS:
        lines += [f"## {title}", ""]
        if section == "search":
            lines += ["A sweep's config (`python -m mpilearn.optimize`) is a training config plus "
                      "a `search` section: ", ""]
        lines += ["| key | default | meaning |", "|---|---|---|"]
        for key, default in keys:
            if not key.startswith(prefixes) and key not in prefixes:
                continue
            parent = key.rpartition(".")[0]
            if parent in config.DESCRIPTIONS and parent not in described:  # a section's own
                described.add(parent)
                lines.append(f"| `{parent}.*` | | {_cell(config.DESCRIPTIONS[parent])} |")
            if key not in config.DESCRIPTIONS:
                LOG.warning(f"config key {key!r} has no description in "
                            "mpilearn/core/config.py DESCRIPTIONS")
                continue
            lines.append(f"| `{key}` | `{_cell(config.show_default(default))}` | "
                         f"{_cell(config.meaning(key))} |")
        lines.append("")
    return "\n".join(lines)


def _help(module: str) -> str:
    env = {**os.environ, "COLUMNS": "100", "OMPI_ALLOW_RUN_AS_ROOT": "1",
           "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    proc = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True,
                          text=True, env=env, timeout=120)
    if proc.returncode != 0:
        LOG.warning(f"{module} --help failed ({proc.returncode}): {proc.stderr[-500:]}")
    return proc.stdout


def cli_page() -> str:
    with ThreadPoolExecutor(4) as pool:
        helps = list(pool.map(_help, [module for _, module in COMMANDS]))
    lines = ["# Commands", "",
             "Every command's `--help`, as it prints it (generated when the docs are built). "
             "Run a command on N ranks with `mpirun -np N ...`, `srun ...` or "
             "`mpilearn-run -np N ...`; the guide pages say when to use which.", ""]
    for (name, _), text in zip(COMMANDS, helps):
        lines += [f"## `{name}`", "", "```text", text.rstrip(), "```", ""]
    return "\n".join(lines)


def write_if_changed(path: str, text: str) -> None:
    if os.path.exists(path) and open(path).read() == text:
        return
    with open(path, "w") as f:
        f.write(text)


def generate(app) -> None:
    ref = os.path.join(app.srcdir, "reference")
    write_if_changed(os.path.join(ref, "config.md"), config_page())
    write_if_changed(os.path.join(ref, "cli.md"), cli_page())


def literal_blocks(app, what, name, obj, options, lines) -> None:
    """The docstrings are plain text, not reStructuredText: an example indented under a line
    of prose becomes a literal block (as a ``::`` would make it), so that autodoc shows it as
    written instead of warning."""
    out, prose, code = [], None, None  # indentation of the last prose line, of the code block
    for line in lines:
        if not line.strip():
            out.append(line)
            continue
        indent = len(line) - len(line.lstrip())
        if code is not None:
            if indent >= code:
                out.append(line)
                continue
            code = None
            if out[-1].strip():
                out.append("")
        if prose is not None and indent >= prose + 4:
            before = [x for x in out if x.strip()]
            if before and before[-1].rstrip().endswith("::"):
                if out[-1].strip():
                    out.append("")
            else:
                out += ([""] if out[-1].strip() else []) + ["::", ""]
            code = indent
        else:
            prose = indent
        out.append(line)
    lines[:] = out


def setup(app):
    app.connect("builder-inited", generate)
    app.connect("autodoc-process-docstring", literal_blocks)
    return {"version": "1", "parallel_read_safe": True}
