"""``hpctrain tune`` on real ranks, the threshold rule, and how init() reads (or refuses) the tuning file."""
import json
import subprocess
import sys

import pytest

import hpctrain
from hpctrain.launcher.tune import SIZES, crossover

from harness import BIN, base_env, mpirun_cmd, run


def test_crossover_is_the_smallest_size_from_which_ours_stays_faster():
    native = {1: 1.0, 4: 1.0, 16: 1.0, 64: 1.0}
    assert crossover(native, {1: 2.0, 4: 0.5, 16: 2.0, 64: 0.5}, 7) == 64    # a loss at 16 moves it up
    assert crossover(native, {1: 2.0, 4: 1.0, 16: 0.9, 64: 0.5}, 7) == 4     # a tie counts as no slower
    assert crossover(native, {1: 0.5, 4: 0.5, 16: 0.5, 64: 0.5}, 7) == 1
    assert crossover(native, {1: 2.0, 4: 2.0, 16: 2.0, 64: 2.0}, 7) == 128   # never: beyond the largest
    assert crossover({}, {}, 7) == 7


@pytest.mark.timeout(300)
def test_tune_measures_on_real_ranks_and_init_reads_the_file(tmp_path):
    out = tmp_path / "tune.json"
    res = run([str(BIN / "hpctrain"), "tune", "-n", "2", "--rounds", "1", "--out", str(out)], base_env(), 240)
    assert res.returncode == 0, res.stdout[-3000:]
    data = json.loads(out.read_text())
    value = data["thresholds"]["shm_min_bytes"]
    assert value in SIZES + [2 * SIZES[-1]]
    assert set(data["times_s"]) == {"native", "shm"} and len(data["times_s"]["shm"]) == len(SIZES)
    assert f"shm_min_bytes = {value} bytes" in res.stdout
    probe = "import hpctrain; c = hpctrain.init(); print('THRESHOLD', c.config.shm_min_bytes)"
    got = run(mpirun_cmd(2) + [sys.executable, "-c", probe], base_env(HPCTRAIN_TUNE_FILE=str(out)), 120)
    assert got.returncode == 0 and got.stdout.count(f"THRESHOLD {value}") == 2, got.stdout[-2000:]
    env_wins = run(mpirun_cmd(2) + [sys.executable, "-c", probe],
                   base_env(HPCTRAIN_TUNE_FILE=str(out), HPCTRAIN_SHM_MIN_BYTES="12345"), 120)
    assert env_wins.stdout.count("THRESHOLD 12345") == 2, env_wins.stdout[-2000:]


def test_tune_refuses_one_rank():
    res = subprocess.run([str(BIN / "hpctrain"), "tune", "-n", "1"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "at least 2 ranks" in res.stderr


@pytest.mark.parametrize("content", ["{not json", '{"thresholds": {"shm_min_bytes": -1}}',
                                     '{"thresholds": {"bogus": 5}}', "[1, 2]"])
def test_a_malformed_tuning_file_is_a_clear_error(tmp_path, monkeypatch, content):
    path = tmp_path / "tune.json"
    path.write_text(content)
    monkeypatch.setenv("HPCTRAIN_TUNE_FILE", str(path))
    with pytest.raises(ValueError, match="tuning file"):
        hpctrain.init("local")
    assert not hpctrain.is_initialized()
