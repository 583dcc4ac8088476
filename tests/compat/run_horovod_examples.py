"""Run Horovod 0.28.1's own PyTorch and TensorFlow 2 example scripts on hpctrain.horovod, only the import
lines changed.

Usage (HOROVOD_SRC: a checkout of horovod/horovod at tag v0.28.1)::

    .venv/bin/python tests/compat/run_horovod_examples.py --src HOROVOD_SRC [--ranks 2] [--impl horovod]

Horovod's examples import torchvision, whose PyPI build needs torch's CUDA
build; with the CPU build ``import torchvision`` fails.  So this harness
writes a stand-in package named ``torchvision`` into the run's scratch folder
(never installed, never shipped) and puts it on that run's PYTHONPATH only:

* ``torchvision.models``: the ResNets of examples/horovod/resnets.py (torch.nn);
* ``torchvision.datasets.MNIST``: reads ``MNIST.npz`` from the data folder
  instead of downloading (no data set can be downloaded here).  The harness
  writes that file from scikit-learn's bundled 8x8 digits, scaled to 28x28
  uint8 images (1437 for training, 360 for testing);
* ``torchvision.transforms``: ``Compose``, ``ToTensor``, ``Normalize``.

The TensorFlow examples run with Keras 2 (tf-keras, ``TF_USE_LEGACY_KERAS=1``)
as Horovod's users run them on TF >= 2.16: they use Keras 2 APIs (``.h5``
checkpoints, ``optimizer.variables()``, ``compile(experimental_run_tf_function=)``).
``tensorflow2_keras_mnist.py`` would download MNIST through
``tf.keras.datasets.mnist.load_data``; the harness writes a ``sitecustomize.py``
into the scratch folder (on that run's PYTHONPATH only) that points
``load_data`` at the same digits file (``x_train``/``y_train``/``x_test``/``y_test``).
It trains 24 epochs as published (a few minutes at 2 ranks).

Each example runs under ``hpctrain launch -np N`` (mpirun) at small sizes;
the harness prints the example's last lines and exits non-zero if one fails.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from run_horovod_tests import rewrite  # noqa: E402

STANDIN = {
    "__init__.py": "from . import datasets, models, transforms  # a stand-in: see tests/compat/run_horovod_examples.py\n",
    "models.py": "from resnets import resnet18, resnet34, resnet50  # noqa: F401\n",
    "transforms.py": '''import torch


class Compose:
    def __init__(self, steps):
        self.steps = steps

    def __call__(self, x):
        for step in self.steps:
            x = step(x)
        return x


class ToTensor:
    def __call__(self, image):
        return torch.from_numpy(image).float().div(255).unsqueeze(0)


class Normalize:
    def __init__(self, mean, std):
        self.mean, self.std = mean[0], std[0]

    def __call__(self, x):
        return (x - self.mean) / self.std
''',
    "datasets.py": '''import os

import numpy as np
import torch


class MNIST(torch.utils.data.Dataset):
    """Reads <root>/MNIST.npz (written by the harness) instead of downloading."""

    def __init__(self, root, train=True, download=False, transform=None):
        data = np.load(os.path.join(root, "MNIST.npz"))
        part = "train" if train else "test"
        self.images, self.labels, self.transform = data[part + "_images"], data[part + "_labels"], transform

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        x = self.images[i]
        return (self.transform(x) if self.transform else x), int(self.labels[i])
''',
}

# Stand-in data for tf.keras.datasets.mnist.load_data (imported at start-up from the run's PYTHONPATH only).
SITECUSTOMIZE = '''import os
if os.environ.get("HPCTRAIN_TEST_MNIST_NPZ"):
    import importlib

    import numpy as np

    def load_data(path="mnist.npz"):
        """The digits of the harness instead of a download (see tests/compat/run_horovod_examples.py)."""
        d = np.load(os.environ["HPCTRAIN_TEST_MNIST_NPZ"])
        return (d["train_images"], d["train_labels"]), (d["test_images"], d["test_labels"])

    for name in ("tf_keras.src.datasets.mnist", "tf_keras.api._v2.keras.datasets.mnist",
                 "keras.src.datasets.mnist", "keras.datasets.mnist"):
        try:
            importlib.import_module(name).load_data = load_data
        except ImportError:
            pass
'''

# run label (the file, then extra arguments) -> (folder in Horovod's examples, arguments)
_SYNTHETIC = ["--model", "resnet18", "--batch-size", "4", "--num-warmup-batches", "1", "--num-batches-per-iter", "2",
              "--num-iters", "2", "--no-cuda"]
EXAMPLES = {
    "pytorch_synthetic_benchmark.py": ("pytorch", _SYNTHETIC),
    "pytorch_synthetic_benchmark.py --use-adasum": ("pytorch", _SYNTHETIC + ["--use-adasum"]),
    "pytorch_mnist.py": ("pytorch", ["--epochs", "2", "--no-cuda", "--log-interval", "20"]),
    "tensorflow2_synthetic_benchmark.py": ("tensorflow2", ["--model", "ResNet50", "--batch-size", "4",
                                                           "--num-warmup-batches", "1", "--num-batches-per-iter",
                                                           "2", "--num-iters", "2", "--no-cuda"]),
    "tensorflow2_keras_mnist.py": ("tensorflow2", []),
}


def write_mnist(folder: str) -> None:
    """MNIST.npz from scikit-learn's digits: 28x28 uint8 images, 80/20 split."""
    from sklearn.datasets import load_digits
    d = load_digits()
    rows = np.arange(28) * 8 // 28
    images = (d.images[:, rows][:, :, rows] * 255 / 16).astype(np.uint8)
    order = np.random.default_rng(0).permutation(len(images))
    cut = int(0.8 * len(images))
    np.savez(os.path.join(folder, "MNIST.npz"), train_images=images[order[:cut]], train_labels=d.target[order[:cut]],
             test_images=images[order[cut:]], test_labels=d.target[order[cut:]])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", required=True)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--impl", choices=("hpctrain", "horovod"), default="hpctrain")
    ap.add_argument("--only", nargs="*", default=sorted(EXAMPLES), help="the examples to run (file names)")
    args = ap.parse_args()
    failed = 0
    with tempfile.TemporaryDirectory(prefix="hvdexamples-") as scratch:
        os.makedirs(os.path.join(scratch, "standin", "torchvision"))
        for name, text in STANDIN.items():
            with open(os.path.join(scratch, "standin", "torchvision", name), "w") as f:
                f.write(text)
        with open(os.path.join(scratch, "standin", "sitecustomize.py"), "w") as f:
            f.write(SITECUSTOMIZE)
        data = os.path.join(scratch, "data")
        os.makedirs(data)
        write_mnist(data)
        env = dict(os.environ, OMP_NUM_THREADS="1", HPCTRAIN_TEST_MNIST_NPZ=os.path.join(data, "MNIST.npz"))
        env["PYTHONPATH"] = os.pathsep.join([os.path.join(scratch, "standin"),
                                             os.path.join(ROOT, "examples", "horovod"), ROOT])
        for label in args.only:
            folder, extra = EXAMPLES[label]
            name = label.split()[0]
            with open(os.path.join(args.src, "examples", folder, name)) as f:
                text = f.read()
            script = os.path.join(scratch, name)
            with open(script, "w") as f:
                f.write(rewrite(text) if args.impl == "hpctrain" else text)
            extra = extra + (["--data-dir", data] if name == "pytorch_mnist.py" else [])
            run_env = dict(env, TF_USE_LEGACY_KERAS="1") if folder == "tensorflow2" else env
            cmd = [os.path.join(os.path.dirname(sys.executable), "hpctrain"), "launch", "-np", str(args.ranks),
                   "python", script] + extra
            proc = subprocess.run(cmd, cwd=scratch, env=run_env, capture_output=True, text=True, timeout=3600)
            lines = [line for line in proc.stdout.splitlines() if line.strip()]
            print(f"== {label} ({args.impl}, {args.ranks} ranks): exit {proc.returncode}")
            print("\n".join(lines[-4:]))
            if proc.returncode:
                print(proc.stderr[-2000:])
                failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
