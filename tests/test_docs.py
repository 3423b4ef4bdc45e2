"""The docs site builds with warnings as errors (a broken cross-reference, a page in no table
of contents, a config key without a description), and says what the code says: every key that
`python -m mpilearn.train --help` and `python -m mpilearn.optimize --help` list is on the built
pages, and every command's --help is. No heading names an issue."""
import glob
import html
import os
import re
import subprocess
import sys

import pytest

from conftest import ENV, REPO

DOCS = os.path.join(REPO, "docs")
HEADING = re.compile(r"^#{1,6} .*$", re.M)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    pytest.importorskip("sphinx", reason="the docs extra is not installed: run make setup")
    pytest.importorskip("myst_parser", reason="the docs extra is not installed: run make setup")
    pytest.importorskip("furo", reason="the docs extra is not installed: run make setup")
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-E",
                           "-b", "html", "-d", str(out / "doctrees"), DOCS, str(out / "html")],
                          capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, f"sphinx-build -W failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return out / "html"


def text(path) -> str:
    """A built page's text, tags removed."""
    return html.unescape(re.sub(r"<[^>]+>", "", open(path).read()))


def help_keys(module):
    """The dotted keys a command's --help lists under its config keys (one a line, first)."""
    out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True,
                         env=ENV, timeout=120).stdout
    listing = out.split(" default, meaning:", 1)[1]
    return re.findall(r"^  ([a-z_]+(?:\.[a-z_]+)*)\s", listing, re.M)


def test_the_site_builds_with_warnings_as_errors_and_holds_every_key_and_command(site):
    config = text(site / "reference" / "config.html")
    keys = help_keys("mpilearn.train") + help_keys("mpilearn.optimize")
    assert len(keys) > 60 and "train.epochs" in keys and "search.budget" in keys
    missing = [k for k in keys if k not in config]
    assert not missing, f"--help lists keys the docs do not: {missing}"
    cli = text(site / "reference" / "cli.html")
    for usage in ("usage: python -m mpilearn.train", "usage: mpilearn-run",
                  "usage: python -m mpilearn.optimize", "usage: python -m mpilearn.validate"):
        assert usage in cli
    api = text(site / "reference" / "api.html")
    for name in ("DistributedOptimizer", "DistributedGradientTape", "SupervisedTask"):
        assert name in api
    for page in ("getting-started", "guide/scaling", "benchmarks/hpo", "contributing"):
        assert (site / f"{page}.html").exists()


def test_no_heading_names_an_issue():
    """Headings say what a page or section is about, not the history that asked for it."""
    pages = glob.glob(os.path.join(DOCS, "**", "*.md"), recursive=True)
    pages += [os.path.join(REPO, "README.md"), os.path.join(REPO, "bench", "RESULTS.md")]
    bad = [(os.path.relpath(p, REPO), h) for p in pages
           for h in HEADING.findall(re.sub(r"```.*?```", "", open(p).read(), flags=re.S))
           if re.search(r"\bissues?\s*#?\d+|#\d+\b", h, re.I)]
    assert not bad, bad


def test_the_readme_is_a_front_page():
    lines = open(os.path.join(REPO, "README.md")).read().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines: move the detail into docs/"
    first_block = "\n".join(lines).split("```", 2)[1]
    assert "make demo" in first_block and "make test" in first_block
