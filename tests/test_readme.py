"""Every block marked runnable in the README and the docs runs as written, in order, on this
2-core machine: the README's first, then the docs pages in PAGES' order (a later block may use
what an earlier one made). A block that appears on two pages (the README's quick start is the
training guide's too) runs once."""
import glob
import os
import re
import subprocess
import sys

from conftest import ENV, REPO
from mpilearn.cluster import sessiondir

BLOCK = re.compile(r"<!-- runnable -->\n```(bash|python)\n(.*?)```", re.S)
PAGES = ["README.md", "docs/getting-started.md", "docs/guide/train.md", "docs/guide/model-files.md",
         "docs/guide/keras.md", "docs/guide/3dgan.md", "docs/guide/fastsim.md",
         "docs/guide/algorithms.md", "docs/guide/horovod.md", "docs/guide/hpo.md",
         "docs/guide/elastic.md", "docs/guide/slurm.md", "docs/guide/kubernetes.md",
         "docs/guide/cost.md", "docs/guide/performance.md", "docs/guide/scaling.md"]


def runnable_blocks():
    """[(page, language, code)] in PAGES' order, each distinct block once."""
    out, seen = [], set()
    for page in PAGES:
        for lang, code in BLOCK.findall(open(os.path.join(REPO, page)).read()):
            if (lang, code) not in seen:
                seen.add((lang, code))
                out.append((page, lang, code))
    return out


def test_every_page_with_runnable_blocks_is_run():
    """A page whose runnable blocks the test would not see is an error, not a silent skip."""
    pages = [os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "**", "*.md"),
                                                        recursive=True)]
    missed = [p for p in pages if p not in PAGES and BLOCK.search(open(os.path.join(REPO, p)).read())]
    assert not missed, f"add {missed} to PAGES in tests/test_readme.py, where their blocks run"


def test_the_readme_runnable_blocks_run_as_written(tmp_path):
    blocks = runnable_blocks()
    assert len(blocks) >= 6, "the README and the docs lost their runnable blocks"
    for name in ("models", "jobs"):  # what a user's checkout has; everything else they make
        os.symlink(os.path.join(REPO, name), tmp_path / name)
    env = {**ENV, "PATH": os.path.dirname(sys.executable) + os.pathsep + ENV["PATH"]}
    for i, (page, lang, code) in enumerate(blocks, 1):
        sessiondir.remove_left_behind()  # another test's killed launcher, as conftest.mpirun
        cmd = ["bash", "-euo", "pipefail", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=900)
        assert proc.returncode == 0, (f"{page}: runnable block {i} ({lang}) failed:\n{code}\n"
                                      f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    assert (tmp_path / "runs" / "hpo-mlp" / "report" / "best.json").exists()
    assert (tmp_path / "runs" / "gan" / "models" / "generator.safetensors").exists()
