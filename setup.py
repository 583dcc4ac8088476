"""Packaging for hpctrain."""
from setuptools import Extension, find_packages, setup

# The mailbox's small all-reduce in C (hpctrain/comm/backends/mpi/_mailbox_kernel.c).  Optional: without a C
# compiler the build skips it and hpctrain runs the same protocol in Python, a few µs slower a call.
KERNEL = Extension("hpctrain.comm.backends.mpi._mailbox_kernel", ["hpctrain/comm/backends/mpi/_mailbox_kernel.c"], optional=True)
# Sums and casts of float16 and bfloat16 buffers in C (hpctrain/_half_kernel.c); optional too: numpy's loops give
# the same bits, 5-50x slower.
HALF = Extension("hpctrain._half_kernel", ["hpctrain/_half_kernel.c"], optional=True,
                 extra_compile_args=["-O3"])

setup(
    name="hpctrain",
    version="0.1.0",
    description="Data- and hybrid-parallel training over MPI and Horovod for PyTorch and TensorFlow",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["hpctrain", "hpctrain.*"]),
    ext_modules=[KERNEL, HALF],
    python_requires=">=3.10",
    install_requires=["numpy>=1.24", "mpi4py>=3.1", "tqdm", "psutil", "zlib-ng"],
    extras_require={
        "torch": ["torch>=2.1"],
        "tensorflow": ["tensorflow-cpu>=2.16"],
        "horovod": ["horovod==0.28.1"],
        "observe": ["tensorboard", "matplotlib"],
        "test": ["pytest>=7", "pytest-timeout>=2", "scikit-learn", "matplotlib", "safetensors"],
    },
    entry_points={"console_scripts": ["hpctrain=hpctrain.launcher.cli:main"]},
)
