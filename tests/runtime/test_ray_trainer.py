"""The trainer placed by Ray (runtime/ray_trainer.py, issue 51 item 2): `--placement ray` on
`pretrain`, `sft` and `rl`.

Default suite: what needs no cluster (the host check against a cluster's nodes, each host's
command, the config and command-line checks). Slow: two trainer hosts placed by Ray on a cluster of
two nodes on this machine (`ray.cluster_utils.Cluster`) train what one process with all the devices
trains, to the step, with the same checkpoints; and a host that fails ends the run with its status.
"""

from __future__ import annotations

import json
import sys

import pytest
from support.multiprocess_launch import REPO, stage_args

from composer_jax.config import ConfigError, load_config
from composer_jax.config.ray import TrainerRayConfig
from composer_jax.errors import UsageError
from composer_jax.runtime import ray_trainer as rt
from composer_jax.runtime.placement import LaunchError
from composer_jax.train.cli import pretrain_main

STAGE = REPO / "configs" / "pretrain" / "tiny_stage1.yaml"


def _node(alive: bool = True, **resources: float) -> dict:
    return {"Alive": alive, "Resources": resources}


def test_the_hosts_must_each_find_a_node_of_their_own():
    two = TrainerRayConfig(hosts=2, cpus_per_host=1, gpus_per_host=8)
    assert rt.host_bundle(two) == {"CPU": 1.0, "GPU": 8.0, "trainer": 1.0}
    rt.check_hosts(two, [_node(CPU=8, GPU=8, trainer=1), _node(CPU=8, GPU=8, trainer=1)])
    # one node with room for both: STRICT_SPREAD still wants two nodes
    with pytest.raises(LaunchError) as err:
        rt.check_hosts(two, [_node(CPU=16, GPU=16, trainer=2), _node(False, CPU=8, GPU=8, trainer=1)])
    assert str(err.value) == (
        "train.ray.hosts=2 places one trainer per node, each asking Ray for {CPU: 1, GPU: 8, trainer: 1}; 1 of the "
        "cluster's 1 alive node(s) can hold one (the cluster has {CPU: 16, GPU: 16, trainer: 2} in all): add nodes, "
        "lower train.ray.hosts, or ask each host for less (train.ray.cpus_per_host, gpus_per_host)"
    )
    # no node has the custom resource: say how to give it, or how to ask for none
    with pytest.raises(LaunchError, match=r"give 2 nodes the resource \(`ray start --resources='\{\"trainer\": 1\}'`"):
        rt.check_hosts(two, [_node(CPU=8, GPU=8), _node(CPU=8, GPU=8)])
    rt.check_hosts(TrainerRayConfig(resource=""), [_node(CPU=1)])


def test_each_host_runs_the_command_joined_to_the_others():
    argv = ["pretrain", "--config", "c.yaml", "train.steps=2"]
    assert rt.host_argv(argv, 0, 1, "10.0.0.1:4000") == [*argv, "train.placement=local"]
    assert rt.host_argv(argv, 1, 2, "10.0.0.1:4000") == [
        *argv,
        "train.placement=local",
        "--coordinator",
        "10.0.0.1:4000",
        "--num-processes",
        "2",
        "--process-id",
        "1",
    ]


def test_bad_trainer_placements_are_named_before_anything_starts(monkeypatch):
    monkeypatch.chdir(REPO)
    with pytest.raises(ConfigError, match=r"train.placement='slurm' is not accepted; accepted: local, ray"):
        load_config(STAGE, ["train.placement=slurm"], num_devices=None)
    with pytest.raises(ConfigError, match=r"train.ray.hosts=0: expected an integer >= 1"):
        load_config(STAGE, ["train.ray.hosts=0"], num_devices=None)
    with pytest.raises(ConfigError, match=r"train.ray.resource='GPU': expected a custom resource name"):
        load_config(STAGE, ["train.ray.resource=GPU"], num_devices=None)
    with pytest.raises(UsageError, match=r"--hosts 2 needs --placement ray"):
        pretrain_main(["--hosts", "2", "--config", str(STAGE)])
    with pytest.raises(UsageError, match=r"--placement ray starts the trainer's processes .* drop --coordinator"):
        pretrain_main(["--placement", "ray", "--coordinator", "127.0.0.1:1", "--config", str(STAGE)])
    with pytest.raises(UsageError, match=r"train.ray.address='127.0.0.1:9': no Ray cluster to join there"):
        pretrain_main(["--placement", "ray", "--config", str(STAGE), "train.ray.address=127.0.0.1:9"])


def _stage_args(out, corpus) -> list[str]:
    return ["--config", str(STAGE), *stage_args(out, corpus)[2:]]


def _losses(out) -> dict[int, float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


# slow (about 2 minutes: three JAX processes and a Ray cluster); tests/train/test_multiprocess.py
# keeps the two-process step's equality to one process, the default tests above the placement's checks
@pytest.mark.slow
def test_two_hosts_placed_by_ray_train_what_one_process_trains(tmp_path, monkeypatch, capsys):
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster
    from support.multiprocess_launch import run_processes

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for f in sorted((REPO / "src" / "composer_jax" / "train").glob("*.py")):
        (corpus / f.name).write_text(f.read_text())
    one = tmp_path / "one"
    run_processes(
        [[sys.executable, "-m", "composer_jax.cli", "pretrain", *_stage_args(one, corpus), "--cpu-devices", "4"]]
    )
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("XLA_FLAGS", "")  # the suite's 8 fake devices are not the hosts' 2 each
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        nodes = [cluster.add_node(num_cpus=1, resources={"trainer": 1}) for _ in range(2)]
        two = tmp_path / "two"
        address = f"train.ray.address={cluster.address}"
        rc = pretrain_main(
            ["--placement", "ray", "--hosts", "2", "--cpu-devices", "2", *_stage_args(two, corpus), address]
        )
        out = capsys.readouterr().out
        assert rc == 0, out[-3000:]
        assert not ray.is_initialized()  # the driver disconnected
        assert "[trainer] placing 2 trainer host(s) on Ray (3 node(s))" in out
        # host 0's final line is printed here, as `pretrain` prints it
        final = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
        assert final["steps"] == 4
        ref, got = _losses(one), _losses(two)
        assert sorted(got) == sorted(ref) == [1, 2, 3, 4]
        for step in ref:
            assert got[step] == pytest.approx(ref[step], rel=2e-6), (step, got, ref)
        assert sorted(int(p.name) for p in (two / "checkpoints").iterdir() if p.name.isdigit()) == [2, 4]
        data_state = json.loads((two / "checkpoints" / "4" / "data_state" / "metadata").read_text())
        assert data_state["shard_count"] == 2 and sorted(data_state["shards"]) == ["0", "1"]

        # a host that fails (a data directory that is not there: the hosts find it, not the
        # driver) ends the run with its exit status
        rc = pretrain_main(
            [
                "--placement",
                "ray",
                "--hosts",
                "2",
                "--cpu-devices",
                "2",
                *_stage_args(two, tmp_path / "nowhere"),
                address,
            ]
        )
        out = capsys.readouterr().out
        assert rc == 2, out[-3000:]
        assert "trainer host" in out and "exited with status 2; stopping the other hosts" in out
        assert len(ray.nodes() if ray.is_initialized() else nodes) == 2
    finally:
        cluster.shutdown()
