"""The `ray` placement (runtime/ray_placement.py, issue 51): a run's services as Ray actors.

Default suite: the checks that need no cluster (a resource no node has, a missing Ray, an address
with no cluster, what an actor raised, configs that cannot be placed), and one RL step on a Ray
cluster of two nodes on this machine (`ray.cluster_utils.Cluster`: the head, labelled
`env_server`, and a node labelled `sampler`), the environment server placed on the one and the
serve replica on the other, the step trained as with the local placement."""

from __future__ import annotations

import builtins
from pathlib import Path

import pytest
from support.bwrap import needs_bwrap
from support.live_env import REPO

from composer_jax.config import ConfigError, load_config
from composer_jax.config.ray import RayConfig
from composer_jax.runtime import ray_placement as rp
from composer_jax.runtime.placement import LaunchError, Resources, ServiceSpec

CONFIG = REPO / "tests" / "rl" / "fixtures" / "rl_pick.yaml"


def _spec(name: str, res: Resources) -> ServiceSpec:
    return ServiceSpec(name, lambda host, port: [], Path("x.log"), resources=res)


def _record_placements(monkeypatch: pytest.MonkeyPatch) -> list[rp.RayPlacement]:
    """Every RayPlacement started from now on, appended as it starts (to read its nodes after the run)."""
    placements: list[rp.RayPlacement] = []
    start = rp.RayPlacement.start

    def recorded(self):
        placements.append(self)
        return start(self)

    monkeypatch.setattr(rp.RayPlacement, "start", recorded)
    return placements


def _node(**resources: float) -> dict:
    return {"Alive": True, "Resources": resources}


def test_a_resource_no_node_has_is_named_with_what_to_do():
    env = _spec("environment server 0", Resources(1, 0, "env_server"))
    nodes = [_node(CPU=4), _node(CPU=2, sampler=1), {"Alive": False, "Resources": {"env_server": 8, "CPU": 8}}]
    with pytest.raises(LaunchError) as err:
        rp.check_resources([env], nodes)
    assert str(err.value).startswith(
        "environment server 0 asks Ray for {CPU: 1, env_server: 1}, which no node of the cluster has (short of "
        "env_server; the cluster has {CPU: 6, sampler: 1}); give nodes the resource "
        "(`ray start --resources='{\"env_server\": 8}'`"
    )
    # each fits a node, the cluster cannot hold all of them at once
    replicas = [_spec(f"sampler replica {i}", Resources(1, 1, "sampler")) for i in range(3)]
    with pytest.raises(
        LaunchError,
        match=r"ask Ray for \{CPU: 3, GPU: 3, sampler: 3\} in all; .*, short of GPU \(3 asked, 1 there\): add nodes",
    ):
        rp.check_resources(replicas, [_node(CPU=8, GPU=1, sampler=4)])
    rp.check_resources(replicas, [_node(CPU=1, GPU=1, sampler=1)] * 3)  # one per node: fits


def test_without_ray_the_error_says_how_to_install_it(monkeypatch):
    real = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("No module named 'ray'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    with pytest.raises(LaunchError, match=r"needs Ray: pip install 'composer-jax\[ray\]'"):
        rp.RayPlacement([_spec("s", Resources())]).start()


def test_what_an_actor_raised_is_its_own_message():
    wrapped = RuntimeError(
        "The actor died because of an error raised in its creation task, ray::ServiceActor.__init__() (pid=1)\n"
        '  File "local.py", line 3, in start\n    raise self.error(self._start_error)\n'
        "composer_jax.runtime.placement.LaunchError: environment server 0 exited with status 2; its log (x.log):\n"
        "usage: composer-jax env-server\nValueError: not this one"
    )
    assert rp.actor_error(wrapped) == (
        "environment server 0 exited with status 2; its log (x.log):\nusage: composer-jax env-server\n"
        "ValueError: not this one"
    )
    assert (
        rp.actor_error(RuntimeError("The actor is temporarily unavailable\nmore"))
        == "The actor is temporarily unavailable"
    )


def test_configs_a_ray_placement_cannot_take(monkeypatch):
    monkeypatch.chdir(REPO)
    with pytest.raises(ConfigError, match="rl.pin_cores=true pins the run's own child processes"):
        load_config(CONFIG, ["rl.placement=ray", "rl.pin_cores=true", "rl.local_samplers=1"])
    vllm = ["rl.placement=ray", "rl.sampler_engine=vllm", "rl.local_samplers=1", "rl.loss.router_replay=false"]
    with pytest.raises(
        ConfigError,
        match=r"each vLLM replica on 2 GPUs \(--tensor-parallel-size\) but rl.ray.sampler_gpus=1 asks Ray for fewer "
        r"per replica: set rl.ray.sampler_gpus=2",
    ):
        load_config(CONFIG, [*vllm, "rl.ray.sampler_gpus=1", "rl.vllm.extra_args=[--tensor-parallel-size, '2']"])
    load_config(CONFIG, [*vllm, "rl.ray.sampler_gpus=2", "rl.vllm.extra_args=[-tp=2]"])
    with pytest.raises(ConfigError, match=r"rl.placement='kubernetes' is not accepted; accepted: local, ray"):
        load_config(CONFIG, ["rl.placement=kubernetes"])
    with pytest.raises(ConfigError, match=r"rl.ray.sampler_resource='GPU': expected a custom resource name"):
        load_config(CONFIG, ["rl.ray.sampler_resource=GPU"])


def test_an_address_with_no_cluster_is_named():
    pytest.importorskip("ray")
    with pytest.raises(LaunchError, match=r"rl.ray.address='127.0.0.1:9': no Ray cluster to join there"):
        rp.connect(RayConfig(address="127.0.0.1:9"))


@needs_bwrap
def test_one_rl_step_with_the_env_server_on_one_node_and_the_replica_on_another(tmp_path, monkeypatch):
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    from composer_jax.rl.learner import run_rl

    monkeypatch.chdir(REPO)
    # two nodes (a third raylet costs seconds of the default suite): the head, labelled env_server,
    # and a node labelled sampler
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"env_server": 1}})
    placements = _record_placements(monkeypatch)
    try:
        env_node = cluster.head_node
        replica_node = cluster.add_node(num_cpus=1, resources={"sampler": 1})
        out = tmp_path / "run"
        cfg = load_config(
            CONFIG,
            [
                f"train.out_dir={out}",
                "train.steps=1",
                "rl.eval_tasks=[]",
                "rl.local_samplers=1",
                "rl.sampler.slots=8",
                "rl.placement=ray",
                f"rl.ray.address={cluster.address}",
            ],
        )
        summary = run_rl(cfg, echo=lambda _: None)
        assert not ray.is_initialized()  # the run disconnected
    finally:
        cluster.shutdown()
    assert summary["final_step"] == 1 and not summary["lost_groups"]
    assert sorted(i for ids in summary["trained_groups"].values() for i in ids) == [0, 1]
    step = summary["steps"][1]
    assert step["version_lag_max"] == 0 and abs(step["mismatch_kl_k1"]) < 1e-4  # the replica sampled these weights
    where = {p.kind: [q.node for q in p._placed] for p in placements}
    assert where == {"env_servers": [env_node.node_id], "samplers": [replica_node.node_id]}
    assert step["env_servers/alive"] == 1.0 and step["samplers/alive"] == 1.0
    assert step["env_servers/moved"] == 0.0


# slow (about 2 minutes): the default suite's two-node step keeps the placement's property; this one
# adds a node's loss mid-run
@pytest.mark.slow
@needs_bwrap
def test_nodes_removed_mid_run_their_services_move_and_the_run_finishes(tmp_path, monkeypatch):
    """The environment server's node and the replica's node are removed after the first step: Ray
    places both again on the spare nodes, the replica rejoins rotation, the environment client
    follows the server to its new address, and the run trains to its last step, no group lost or
    trained twice."""
    import threading
    import time

    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    from composer_jax.rl.learner import run_rl

    monkeypatch.chdir(REPO)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    placements = _record_placements(monkeypatch)
    out = tmp_path / "run"
    removed: list[str] = []
    try:
        first = [cluster.add_node(num_cpus=1, resources={r: 1}) for r in ("env_server", "sampler")]
        spares: list = []
        cfg = load_config(
            CONFIG,
            [
                f"train.out_dir={out}",
                "train.steps=3",
                "rl.eval_tasks=[]",
                "rl.local_samplers=1",
                "rl.sampler.slots=8",
                "rl.placement=ray",
                f"rl.ray.address={cluster.address}",
                "rl.supervision.backoff_s=0.5",
            ],
        )
        # the run in a thread: Ray's cluster utilities start and stop nodes from the main thread only
        result: dict = {}

        def run() -> None:
            try:
                result["summary"] = run_rl(cfg, echo=lambda _: None)
            except BaseException as exc:
                result["error"] = exc

        runner = threading.Thread(target=run, daemon=True)
        runner.start()
        deadline = time.monotonic() + 600
        while runner.is_alive() and time.monotonic() < deadline:
            m = out / "metrics.jsonl"
            if m.exists() and '"step": 1,' in m.read_text():
                # the spares join only now: the services were placed on the first two nodes
                spares.extend(cluster.add_node(num_cpus=1, resources={r: 1}) for r in ("env_server", "sampler"))
                for node in first:
                    cluster.remove_node(node)
                    removed.append(node.node_id)
                break
            time.sleep(0.1)
        runner.join(600)
        if "error" in result:
            raise result["error"]
        summary = result["summary"]
        assert not ray.is_initialized()
    finally:
        cluster.shutdown()
    assert len(removed) == 2, "the watcher removed no node"
    assert summary["final_step"] == 3 and not summary["lost_groups"] and not summary["dropped_stale_groups"]
    assert sorted(i for ids in summary["trained_groups"].values() for i in ids) == list(range(6))
    where = {p.kind: [q.node for q in p._placed] for p in placements}
    assert where == {"env_servers": [spares[0].node_id], "samplers": [spares[1].node_id]}
    last = summary["steps"][3]
    assert last["samplers/moved"] == 1.0 and last["env_servers/moved"] == 1.0
    assert last["samplers/rejoined"] >= 1.0
