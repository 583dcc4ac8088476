"""hpctrain.settings is the one table of HPCTRAIN_* variables and the only code under hpctrain/ that reads them."""
import ast
import re
from pathlib import Path

import pytest

from harness import REPO
from hpctrain import settings
from hpctrain.comm.life.runtime import Config
from hpctrain.launcher.launch import build_command
from hpctrain.settings import SettingError

PACKAGE = REPO / "hpctrain"
NAME = re.compile(r"HPCTRAIN_[A-Z0-9_]+")
SETTINGS_CALLS = {"get", "default", "setting"}


def _names_outside_settings_calls(path: Path):
    """Yield (line, text) of string constants that are an HPCTRAIN_* name (or the bare prefix), except in the
    name argument of a ``settings.get/default/setting`` call: anything else would read the variable itself."""
    tree = ast.parse(path.read_text(), str(path))
    allowed = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "settings"
                and node.func.attr in SETTINGS_CALLS and node.args):
            allowed.update(id(n) for n in ast.walk(node.args[0]))
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                and (NAME.fullmatch(node.value) or node.value == "HPCTRAIN_")
                and id(node) not in allowed and id(node) not in docstrings):
            yield node.lineno, node.value


def test_no_module_but_settings_reads_an_hpctrain_variable():
    offenders = [f"{p.relative_to(REPO)}:{line}: {text!r}" for p in sorted(PACKAGE.rglob("*.py"))
                 if p.name != "settings.py" for line, text in _names_outside_settings_calls(p)]
    assert not offenders, "read HPCTRAIN_* through hpctrain.settings.get():\n" + "\n".join(offenders)


def test_the_scan_catches_a_direct_read(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('import os\nx = os.environ.get("HPCTRAIN_CHECK")\ny = settings.get("HPCTRAIN_CHECK")\n')
    assert list(_names_outside_settings_calls(bad)) == [(2, "HPCTRAIN_CHECK")]


def test_every_variable_the_code_and_scripts_mention_is_in_the_table():
    files = [*PACKAGE.rglob("*.py"), *(REPO / "slurm").iterdir(), *(REPO / "scripts").iterdir()]
    mentioned = {name for f in files if f.is_file() for name in NAME.findall(f.read_text(errors="replace"))
                 if not name.endswith("_")}          # (a prefix such as settings.TEST_PREFIX is no variable)
    table = {s.name for s in settings.SETTINGS}
    assert mentioned - table == set()
    # and every setting hpctrain itself reads is asked for somewhere outside the table
    code = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py") if p.name != "settings.py")
    unused = [s.name for s in settings.SETTINGS if s.reader == "hpctrain"
              and f'"{s.name}"' not in code and s.name[len("HPCTRAIN_"):].lower() not in Config.__dataclass_fields__]
    assert unused == []


def test_readme_settings_table_is_the_module_table():
    readme = (REPO / "README.md").read_text()
    assert settings.markdown_table() in readme, ("the README's settings table differs from hpctrain.settings; "
                                                 "paste settings.markdown_table() into it")


@pytest.mark.parametrize("name, text, value", [
    ("HPCTRAIN_CHECK", "off", False), ("HPCTRAIN_CHECK", " Yes ", True), ("HPCTRAIN_CHECK", "", True),
    ("HPCTRAIN_FUSION_THRESHOLD", "1e6", 1_000_000), ("HPCTRAIN_FUSION_THRESHOLD", "64MiB", 64 << 20),
    ("HPCTRAIN_SHM_MIN_BYTES", " 256 KiB", 256 << 10), ("HPCTRAIN_STALL_TIMEOUT_S", "0", 0.0),
    ("HPCTRAIN_STALL_WARNING_S", "2.5", 2.5), ("HPCTRAIN_BACKEND", "horovod", "horovod"),
    ("HPCTRAIN_RANKS_PER_NODE", "2", 2), ("HPCTRAIN_TUNE_FILE", "/x y/t.json", "/x y/t.json"),
])
def test_values_parse(name, text, value):
    got = settings.get(name, {name: text})
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize("name, text, allowed", [
    ("HPCTRAIN_CHECK", "maybe", "1/0, true/false, yes/no, on/off"),
    ("HPCTRAIN_FUSION_THRESHOLD", "64MB", "bytes (e.g. 65536, 1e6, 64KiB, 64MiB, 1GiB), at least 1"),
    ("HPCTRAIN_FUSION_THRESHOLD", "64k", "bytes (e.g. 65536, 1e6, 64KiB, 64MiB, 1GiB), at least 1"),
    ("HPCTRAIN_FUSION_THRESHOLD", "0", "bytes (e.g. 65536, 1e6, 64KiB, 64MiB, 1GiB), at least 1"),
    ("HPCTRAIN_SHM_ARENA_BYTES", "1000", "bytes (e.g. 65536, 1e6, 64KiB, 64MiB, 1GiB), at least 4096"),
    ("HPCTRAIN_RING_CHUNK_BYTES", "1.5", "bytes (e.g. 65536, 1e6, 64KiB, 64MiB, 1GiB), at least 1"),
    ("HPCTRAIN_STALL_TIMEOUT_S", "-1", "seconds, at least 0"),
    ("HPCTRAIN_BACKEND", "nccl", "auto, mpi, horovod, local"),
    ("HPCTRAIN_RANKS_PER_NODE", "two", "a whole number, at least 0"),
])
def test_a_bad_value_names_the_variable_and_what_is_allowed(name, text, allowed):
    with pytest.raises(SettingError) as err:
        settings.get(name, {name: text})
    assert str(err.value) == f"{name}={text!r}: expected {allowed}"


@pytest.fixture
def clean_env(monkeypatch):
    """No HPCTRAIN_* variable from the caller's environment."""
    import os
    for name in [k for k in os.environ if k.startswith("HPCTRAIN_")]:
        monkeypatch.delenv(name)
    return monkeypatch


def test_init_settings_and_the_launcher_report_bad_values(clean_env, tmp_path):
    monkeypatch = clean_env
    monkeypatch.setenv("HPCTRAIN_TUNE_FILE", str(tmp_path / "none.json"))
    monkeypatch.setenv("HPCTRAIN_NATIVE_KERNEL", "perhaps")
    with pytest.raises(SettingError, match="HPCTRAIN_NATIVE_KERNEL='perhaps': expected 1/0"):
        Config.from_env()
    monkeypatch.setenv("HPCTRAIN_NATIVE_KERNEL", "0")
    monkeypatch.setenv("HPCTRAIN_SHM_MIN_BYTES", "4096")
    cfg = Config.from_env()
    assert cfg.native_kernel is False and cfg.shm_min_bytes == 4096 and cfg == Config(native_kernel=False,
                                                                                       shm_min_bytes=4096)
    with pytest.raises(SettingError, match=r"HPCTRAIN_LAUNCHER='ssh': expected \(empty\), mpirun, srun"):
        build_command(2, ["python", "x.py"], env={"HPCTRAIN_LAUNCHER": "ssh"})


def test_a_tuning_file_value_below_the_minimum_is_an_error(clean_env, tmp_path):
    monkeypatch = clean_env
    tune = tmp_path / "tune.json"
    tune.write_text('{"thresholds": {"shm_arena_bytes": 100}}')
    monkeypatch.setenv("HPCTRAIN_TUNE_FILE", str(tune))
    with pytest.raises(SettingError, match="shm_arena_bytes=100 in the tuning file .*at least 4096"):
        Config.from_env()
    tune.write_text('{"thresholds": {"shm_arena_bytes": 8192}}')
    assert Config.from_env().shm_arena_bytes == 8192
    monkeypatch.setenv("HPCTRAIN_SHM_ARENA_BYTES", "16384")      # the variable wins over the file
    assert Config.from_env().shm_arena_bytes == 16384


def test_unknown_names_say_which_setting_was_meant_and_leave_the_test_suites_own_alone():
    env = {"HPCTRAIN_TIMELIN": "x", "HPCTRAIN_STALL_TIMEOUT": "5", "HPCTRAIN_CHECK": "1", "HPCTRAIN_TEST_X": "1",
           "HPCTRAIN_WHATEVER_ELSE_ENTIRELY": "1", "OTHER": "1"}
    assert settings.unknown_names(env) == [
        "HPCTRAIN_STALL_TIMEOUT is not an hpctrain setting and is ignored (did you mean HPCTRAIN_STALL_TIMEOUT_S?)",
        "HPCTRAIN_TIMELIN is not an hpctrain setting and is ignored (did you mean HPCTRAIN_TIMELINE?)",
        "HPCTRAIN_WHATEVER_ELSE_ENTIRELY is not an hpctrain setting and is ignored (see the README's settings table)"]
