"""hpctrain.memory: after init, a block freed in one step and allocated again in the next causes no page faults.

The reference is the kernel's count of minor page faults (``getrusage``) in a
fresh process: with glibc as it comes, part of a step's four 12 MiB blocks
is mapped afresh every step (heap memory handed back to the kernel when it
was freed; about 2000 faults per step here, the test asks for more than an
eighth of the 12288 pages); with :func:`keep_freed_memory` the next step
reuses the pages of the step before.  Each case runs in its own process
because ``mallopt`` is process-wide and cannot be undone.
"""
import json
import os
import subprocess
import sys

import pytest

from harness import REPO

PROGRAM = r"""
import json, resource, sys
import numpy as np
from hpctrain import memory
note = memory.keep_freed_memory() if sys.argv[1] == "keep" else "not called"
def faults_of_a_step():                               # four 12 MiB blocks written, then all freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [np.empty(3 << 20, dtype=np.float32) for _ in range(4)]
    for block in blocks:
        block.fill(1.0)
    del blocks, block
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults_of_a_step()                                    # the first step maps the pages in either case
print(json.dumps({"note": note, "faults": [faults_of_a_step() for _ in range(3)]}))
"""

PAGES = (48 << 20) // 4096


def run(mode, **env):
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "HPCTRAIN_KEEP_FREED_MEMORY")}
    proc = subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, timeout=60,
                          cwd=REPO, env=dict(clean, **env))
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def glibc():
    import ctypes
    try:
        ctypes.CDLL(None).gnu_get_libc_version
        return True
    except AttributeError:
        return False


@pytest.mark.skipif(not glibc(), reason="the allocator settings are glibc's")
def test_a_block_freed_and_allocated_again_reuses_its_pages():
    plain, kept = run("plain"), run("keep")
    assert min(plain["faults"]) > PAGES // 8, plain        # the reference: glibc maps part of it afresh each step
    assert kept["note"].startswith("glibc malloc:"), kept
    assert max(kept["faults"]) < PAGES // 100, kept         # the same pages again


@pytest.mark.skipif(not glibc(), reason="the allocator settings are glibc's")
@pytest.mark.parametrize("env, reason", [({"HPCTRAIN_KEEP_FREED_MEMORY": "0"}, "HPCTRAIN_KEEP_FREED_MEMORY=0"),
                                         ({"MALLOC_TRIM_THRESHOLD_": "131072"}, "MALLOC_TRIM_THRESHOLD_ set"),
                                         ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, "GLIBC_TUNABLES set")])
def test_the_users_allocator_choices_are_left_alone(env, reason):
    out = run("keep", **env)
    assert out["note"].startswith("left as is") and reason in out["note"], out
    if "MALLOC_TRIM_THRESHOLD_" not in env:                  # (that one alone changes the faults itself)
        assert min(out["faults"]) > PAGES // 8, out


def test_init_applies_it():
    code = ("import hpctrain, hpctrain.memory as m; hpctrain.init('local'); "
            "print(m.keep_freed_memory())")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO,
                          env=dict(clean, HPCTRAIN_KEEP_FREED_MEMORY="1"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().startswith("glibc malloc:" if glibc() else "left as is"), proc.stdout


@pytest.mark.skipif(not glibc(), reason="the allocator settings are glibc's")
def test_the_environment_variables_give_a_process_without_hpctrain_the_same_settings():
    from hpctrain.memory import environment

    out = run("plain", **environment())
    assert max(out["faults"]) < PAGES // 100, out
    assert run("keep", **environment())["note"].startswith("left as is: MALLOC_MMAP_THRESHOLD_"), out
