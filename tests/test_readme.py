"""Every README block marked runnable runs as written, in order, on this 2-core machine."""
import os
import re
import subprocess
import sys

from conftest import ENV, REPO

BLOCK = re.compile(r"<!-- runnable -->\n```(bash|python)\n(.*?)```", re.S)


def test_the_readme_runnable_blocks_run_as_written(tmp_path):
    text = open(os.path.join(REPO, "README.md")).read()
    blocks = BLOCK.findall(text)
    assert len(blocks) >= 6, "the README lost its runnable blocks"
    for name in ("models", "jobs"):  # what a user's checkout has; everything else they make
        os.symlink(os.path.join(REPO, name), tmp_path / name)
    env = {**ENV, "PATH": os.path.dirname(sys.executable) + os.pathsep + ENV["PATH"]}
    for i, (lang, code) in enumerate(blocks, 1):
        cmd = ["bash", "-euo", "pipefail", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=900)
        assert proc.returncode == 0, (f"README runnable block {i} ({lang}) failed:\n{code}\n"
                                      f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    assert (tmp_path / "runs" / "hpo-mlp" / "report" / "best.json").exists()
    assert (tmp_path / "runs" / "gan" / "models" / "generator.safetensors").exists()
