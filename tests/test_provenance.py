"""Only the project's own code is in the repository: no file carries another project's
copyright or licence header (a peer's code is run from its own checkout by a bench, never
copied in)."""
import re
import subprocess

from conftest import REPO

# a header line of someone else's: a copyright, "all rights reserved", an SPDX tag or the
# Apache/GPL boilerplate; the project itself has none, so any such line is foreign unless it
# names mpilearn
HEADER = re.compile(r"copyright\s*(\(c\)|©|\d{4})|all rights reserved|spdx-license-identifier"
                    r"|licensed under the (apache|gnu|mit)", re.IGNORECASE)
OURS = re.compile(r"mpilearn", re.IGNORECASE)


def foreign_header_lines(text: str) -> list:
    return [line.strip() for line in text.splitlines()
            if HEADER.search(line) and not OURS.search(line)]


def repository_files() -> list:
    """Tracked files and new ones that git does not ignore (what a commit would hold)."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=REPO, capture_output=True, check=True).stdout
    return [name for name in out.decode().split("\0") if name]


def test_the_pattern_finds_the_headers_it_is_for():
    uber = "# Copyright 2019 Uber Technologies, Inc. All Rights Reserved."
    assert foreign_header_lines(f"import os\n{uber}\n") == [uber]
    assert foreign_header_lines("# SPDX-License-Identifier: MIT\n")
    assert foreign_header_lines("# Licensed under the Apache License, Version 2.0\n")
    assert not foreign_header_lines("# the copyright test lives in tests/test_provenance.py\n")


def test_no_file_carries_another_projects_copyright_header():
    files = repository_files()
    assert len(files) > 100  # the listing worked
    found = {}
    for name in files:
        if name == "tests/test_provenance.py":  # its examples above
            continue
        try:
            with open(f"{REPO}/{name}", "rb") as f:
                data = f.read()
        except (FileNotFoundError, IsADirectoryError):  # deleted in the work tree, a submodule
            continue
        if b"\0" in data[:8192]:
            continue  # binary
        lines = foreign_header_lines(data.decode("utf-8", "replace"))
        if lines:
            found[name] = lines[:3]
    assert not found, found

