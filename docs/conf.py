"""Sphinx configuration of mpilearn's docs (Markdown pages through MyST, the furo theme).

`make docs` builds them into docs/_build/html; tests/test_docs.py builds them with warnings as
errors. The config reference and every command's --help are generated at build time from the
code (docs/_ext/mpilearn_docs.py), so they cannot drift from it."""
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # autodoc imports TensorFlow: no start-up chatter
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "_ext"))
sys.path.insert(0, os.path.dirname(HERE))

project = "mpilearn"
author = "the mpilearn developers"
copyright = "the mpilearn developers"
extensions = ["myst_parser", "sphinx.ext.autodoc", "mpilearn_docs"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "README.md"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 4  # [text](page.md#a-heading) links, checked at build time
html_theme = "furo"
html_title = "mpilearn"
html_static_path = []
autodoc_member_order = "bysource"
autodoc_typehints = "none"  # the signatures stay short; the docstrings say what a value is
autodoc_inherit_docstrings = False  # Keras' own callback docstrings are not ours
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": False}
# nothing is fetched while building (no intersphinx): the site builds offline
nitpicky = False
