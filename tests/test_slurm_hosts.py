"""hpctrain.slurm: host list and task count expansion, checked against hand-expanded lists."""
import pytest

from hpctrain.slurm import expand_hostlist, expand_tasks_per_node, horovod_hosts


@pytest.mark.parametrize("spec, hosts", [
    ("vm", ["vm"]),
    ("n[1-3]", ["n1", "n2", "n3"]),
    ("gpu[008-011,020],login1", ["gpu008", "gpu009", "gpu010", "gpu011", "gpu020", "login1"]),
    ("r[1-2]n[07-08]", ["r1n07", "r1n08", "r2n07", "r2n08"]),
])
def test_host_lists_expand_like_scontrol(spec, hosts):
    assert expand_hostlist(spec) == hosts


def test_tasks_per_node_and_horovod_hosts():
    assert expand_tasks_per_node("4(x2),3") == [4, 4, 3]
    env = {"SLURM_JOB_NODELIST": "a[1-2],b", "SLURM_TASKS_PER_NODE": "2(x2),1"}
    assert horovod_hosts(env) == "a1:2,a2:2,b:1"


@pytest.mark.parametrize("env, message", [
    ({"SLURM_TASKS_PER_NODE": "2"}, "SLURM_JOB_NODELIST is not set"),
    ({"SLURM_JOB_NODELIST": "a[1-2]", "SLURM_TASKS_PER_NODE": "2"}, "2 hosts but SLURM_TASKS_PER_NODE 1"),
    ({"SLURM_JOB_NODELIST": "a[1-2", "SLURM_TASKS_PER_NODE": "2"}, "unbalanced"),
    ({"SLURM_JOB_NODELIST": "a[3-1]", "SLURM_TASKS_PER_NODE": "2"}, "descending"),
    ({"SLURM_JOB_NODELIST": "a", "SLURM_TASKS_PER_NODE": "x"}, "bad SLURM_TASKS_PER_NODE"),
])
def test_bad_slurm_variables_get_clear_errors(env, message):
    with pytest.raises(ValueError, match=message):
        horovod_hosts(env)
