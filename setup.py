"""A shim over pyproject.toml (which holds all the metadata) for tools that still call
setup.py; it adds one build step: jobs/ goes into the wheel as mpilearn/jobs_data/."""
import glob
import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
JOBS = ("*.yaml", "*.sbatch", "*.sh")


class BuildWithJobs(build_py):
    def run(self):
        super().run()
        target = os.path.join(self.build_lib, "mpilearn", "jobs_data")
        os.makedirs(target, exist_ok=True)
        for pattern in JOBS:
            for path in glob.glob(os.path.join(HERE, "jobs", pattern)):
                shutil.copy2(path, target)


setup(cmdclass={"build_py": BuildWithJobs})
