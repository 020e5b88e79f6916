"""keras_fastloop.cluster: TF_CONFIG from Slurm, Kubernetes and host lists; checks before training.

The parsing tests are pure functions on fake environments. The slow tests start 2 local
processes through `keras-fastloop launch --cluster` with a faked Slurm or Kubernetes
environment; both must train and end with the same weights.
"""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from keras_fastloop import cluster
from keras_fastloop_cli import launch as launch_module


@pytest.mark.parametrize(
    "nodelist, expected",
    [
        ("node01", ["node01"]),
        ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
        ("a[8-10],b", ["a8", "a9", "a10", "b"]),
        ("gpu[1-2]-ib,cpu[001-002]", ["gpu1-ib", "gpu2-ib", "cpu001", "cpu002"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ],
)
def test_expand_slurm_nodelist(nodelist, expected):
    assert cluster.expand_slurm_nodelist(nodelist) == expected


@pytest.mark.parametrize("bad", ["", "node[01-03", "node]1[", "a,,b", "n[3-1]", "n[x]"])
def test_expand_slurm_nodelist_rejects(bad):
    with pytest.raises(ValueError):
        cluster.expand_slurm_nodelist(bad)


def slurm(procid, nodelist="node[01-02]", ntasks=4, per_node="2(x2)"):
    return {
        "SLURM_JOB_NODELIST": nodelist,
        "SLURM_NTASKS": str(ntasks),
        "SLURM_TASKS_PER_NODE": per_node,
        "SLURM_PROCID": str(procid),
    }


def test_slurm_two_tasks_per_node():
    config = cluster.tf_config_from_env(slurm(3), port=2000)
    assert config == {
        "cluster": {"worker": ["node01:2000", "node01:2001", "node02:2000", "node02:2001"]},
        "task": {"type": "worker", "index": 3},
    }


@pytest.mark.parametrize(
    "env, match",
    [
        (slurm(4), "task.index"),
        (slurm(0, per_node="3,2"), "SLURM_TASKS_PER_NODE must add up"),
        (slurm(0, per_node="2"), "one count per node"),
        ({**slurm(0), "SLURM_DISTRIBUTION": "cyclic"}, "block"),
        ({**slurm(0), "SLURM_PROCID": ""}, "SLURM_PROCID"),
    ],
)
def test_slurm_bad_input(env, match):
    with pytest.raises(ValueError, match=match):
        cluster.tf_config_from_env(env, port=2000)


def test_kubernetes_indexed_job_and_statefulset():
    job = {
        "HOSTNAME": "train-1",
        "JOB_COMPLETION_INDEX": "1",
        "KERAS_FASTLOOP_WORKERS": "3",
        "KERAS_FASTLOOP_SERVICE": "train-svc",
    }
    assert cluster.tf_config_from_env(job, port=2222) == {
        "cluster": {
            "worker": [f"train-{i}.train-svc:2222" for i in range(3)],
        },
        "task": {"type": "worker", "index": 1},
    }
    sts = {"HOSTNAME": "my-set-2", "KERAS_FASTLOOP_WORKERS": "3", "KERAS_FASTLOOP_SERVICE": "s"}
    config = cluster.tf_config_from_env(sts, port=1)
    assert config["task"]["index"] == 2
    assert config["cluster"]["worker"][0] == "my-set-0.s:1"


@pytest.mark.parametrize(
    "env",
    [
        {"HOSTNAME": "trainer", "KERAS_FASTLOOP_WORKERS": "2"},  # no index anywhere
        {"HOSTNAME": "trainer-5", "KERAS_FASTLOOP_WORKERS": "2"},  # out of range
        {"HOSTNAME": "x-0", "KERAS_FASTLOOP_WORKERS": ""},
    ],
)
def test_kubernetes_bad_input(env):
    with pytest.raises(ValueError):
        cluster.tf_config_from_env(env)


def test_explicit_hosts_and_no_cluster():
    env = {"KERAS_FASTLOOP_HOSTS": "a:1, b:2", "KERAS_FASTLOOP_INDEX": "1"}
    assert cluster.tf_config_from_env(env)["cluster"]["worker"] == ["a:1", "b:2"]
    with pytest.raises(ValueError, match="KERAS_FASTLOOP_INDEX"):
        cluster.tf_config_from_env({"KERAS_FASTLOOP_HOSTS": "a:1,b:2"})
    with pytest.raises(ValueError, match="No cluster found"):
        cluster.tf_config_from_env({})


def test_check_tf_config_bad_input():
    base = {"cluster": {"worker": ["h:1", "h:2"]}, "task": {"type": "worker", "index": 0}}
    with pytest.raises(ValueError, match="once"):
        cluster.check_tf_config({**base, "cluster": {"worker": ["h:1", "h:1"]}}, False)
    with pytest.raises(ValueError, match="task.index"):
        cluster.check_tf_config({**base, "task": {"type": "worker"}}, False)
    with pytest.raises(ValueError, match="host:port"):
        cluster.check_tf_config({**base, "cluster": {"worker": ["h", "g:1"]}}, False)
    with pytest.raises(ValueError, match="JSON"):
        cluster.check_tf_config("{", False)
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        port = s.getsockname()[1]
        config = {"cluster": {"worker": [f"127.0.0.1:{port}"]}, "task": {"index": 0}}
        with pytest.raises(ValueError, match="port is in use"):
            cluster.check_tf_config(config)


def test_cli_cluster_errors_before_running_the_script(tmp_path, capsys):
    marker = tmp_path / "ran"
    script = tmp_path / "s.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    with pytest.raises(SystemExit) as e:
        launch_module.main(["--hosts", "a:1,a:1", "--index", "0", "--", str(script)])
    assert e.value.code == 2
    assert "once" in capsys.readouterr().err
    assert not marker.exists()


WORKER = os.path.join(os.path.dirname(__file__), "preemption_worker.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_two(tmp_path, envs):
    config = {"out": str(tmp_path / "w"), "backup_dir": str(tmp_path / "b"), "epochs": 1}
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    processes = []
    for extra in envs:
        env = {
            **os.environ,
            "TF_CPP_MIN_LOG_LEVEL": "3",
            "CUDA_VISIBLE_DEVICES": "",
            "PYTHONPATH": path,
        }
        env.pop("TF_CONFIG", None)
        env.update(extra)
        command = [sys.executable, "-m", "keras_fastloop_cli", "launch", "--cluster"]
        command += ["--", WORKER, json.dumps(config)]
        processes.append(
            subprocess.Popen(
                command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    outputs = []
    try:
        for p in processes:
            outputs.append(p.communicate(timeout=300)[0])
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
    for p, out in zip(processes, outputs):
        assert p.returncode == 0, out[-3000:]
    for i, out in enumerate(outputs):
        assert f"[launch] worker {i} of 2" in out, out[-3000:]
        line = f"[keras_fastloop] worker {i} of 2: 2 replicas (1 here), global batch 8"
        assert line in out, out[-3000:]
    a, b = dict(np.load(config["out"] + ".npz")), dict(np.load(config["out"] + ".worker1.npz"))
    assert sorted(a) == sorted(b)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])
    return outputs


@pytest.mark.slow
@pytest.mark.distributed
def test_fake_slurm_two_local_workers_agree(tmp_path):
    port = launch_module.free_ports(1)[0]
    common = {
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_NTASKS": "2",
        "SLURM_TASKS_PER_NODE": "2",
        "KERAS_FASTLOOP_PORT": str(port),
    }
    run_two(tmp_path, [{**common, "SLURM_PROCID": str(i)} for i in range(2)])


@pytest.mark.slow
@pytest.mark.distributed
def test_fake_kubernetes_indexed_job_two_local_workers_agree(tmp_path):
    port = launch_module.free_ports(1)[0]
    common = {
        "KERAS_FASTLOOP_WORKERS": "2",
        "KERAS_FASTLOOP_PORT": str(port),
        # One machine stands in for the pods: distinct ports instead of pod DNS names.
        "KERAS_FASTLOOP_ADDRESS": "127.0.0.1:{port_index}",
    }
    envs = [{**common, "HOSTNAME": f"train-{i}", "JOB_COMPLETION_INDEX": str(i)} for i in range(2)]
    run_two(tmp_path, envs)


STRATEGY_SCRIPT = """
import sys
import time

import tensorflow as tf

from keras_fastloop import cluster

start = time.monotonic()
try:
    strategy = cluster.multi_worker_strategy(connect_timeout=float(sys.argv[1]))
    total = strategy.reduce(
        "SUM", strategy.run(lambda: tf.constant(1.0 + strategy.cluster_resolver.task_id)), None
    )
    print("SUM", float(total))
except tf.errors.DeadlineExceededError as error:
    print("TIMEOUT", round(time.monotonic() - start), type(error).__name__)
    sys.exit(3)
"""


def run_strategy_workers(tmp_path, indices, connect_timeout):
    script = tmp_path / "strategy.py"
    script.write_text(STRATEGY_SCRIPT)
    ports = launch_module.free_ports(2)
    config = {"worker": [f"127.0.0.1:{port}" for port in ports]}
    processes = []
    for index in indices:
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
        env["TF_CONFIG"] = json.dumps(
            {"cluster": config, "task": {"type": "worker", "index": index}}
        )
        command = [sys.executable, str(script), str(connect_timeout)]
        processes.append(
            subprocess.Popen(
                command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    try:
        return [(p.communicate(timeout=120)[0], p.returncode) for p in processes]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()


@pytest.mark.slow
@pytest.mark.distributed
def test_multi_worker_strategy_connects_two_workers(tmp_path):
    for out, code in run_strategy_workers(tmp_path, [0, 1], connect_timeout=60):
        assert code == 0, out[-3000:]
        assert "SUM 3.0" in out, out[-3000:]  # 1 + 2: both workers took part


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("index", [0, 1])
def test_multi_worker_strategy_gives_up_on_an_absent_peer(tmp_path, index):
    # worker 0 hosts the coordination service: without the register barrier it waited forever
    ((out, code),) = run_strategy_workers(tmp_path, [index], connect_timeout=5)
    assert code == 3, out[-3000:]
    seconds = int(out.split("TIMEOUT ")[1].split()[0])
    assert seconds < 60, out[-3000:]
