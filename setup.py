"""Packaging for hpctrain."""
from setuptools import find_packages, setup

setup(
    name="hpctrain",
    version="0.1.0",
    description="Data- and hybrid-parallel training over MPI and Horovod for PyTorch and TensorFlow",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["hpctrain", "hpctrain.*"]),
    python_requires=">=3.10",
    install_requires=["numpy>=1.24", "mpi4py>=3.1", "tqdm"],
    extras_require={
        "torch": ["torch>=2.1"],
        "tensorflow": ["tensorflow-cpu>=2.16"],
        "horovod": ["horovod==0.28.1"],
        "test": ["pytest>=7", "pytest-timeout>=2", "scikit-learn", "matplotlib", "safetensors"],
    },
    entry_points={"console_scripts": ["hpctrain=hpctrain.cli:main"]},
)
