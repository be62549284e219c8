"""The cluster recipes under deploy/ (docs/cluster.md): each is read as the tool that takes it would
read it, checked by hand against what that tool documents, and its `composer-jax rl` command is
parsed by the real CLI parser and loaded as a config, whose fleet (`inspection_rl.ray_resources`)
the recipe's nodes must hold. The trainer is the driver, not a Ray actor: it runs on the Ray head (the
node the Slurm script runs on, the RayJob's head pod), which must hold the trainer's GPUs and offer Ray
none of them (nor any custom resource), so that no replica is placed on the trainer's GPUs.

- deploy/kuberay/rayjob.yaml, a KubeRay RayJob (PyYAML; the schema's fields checked one by one);
- deploy/slurm/ray_on_slurm.sbatch, a Ray-on-Slurm batch script: `bash -n`, its #SBATCH lines, and
  a run under stand-ins for scontrol, srun, hostname, Python and composer-jax that record their
  arguments (no Slurm or Ray here), so the `ray start` commands and the run's are the script's own."""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from composer_jax.config import MESH_AXES, Config, load_config
from composer_jax.inspection_rl import ray_resources
from composer_jax.rl.cli import _rl_parser
from composer_jax.train.cli import placement_overrides

ROOT = Path(__file__).resolve().parents[1]
RAYJOB = ROOT / "deploy" / "kuberay" / "rayjob.yaml"
SBATCH = ROOT / "deploy" / "slurm" / "ray_on_slurm.sbatch"
IMAGE_PLACEHOLDER = "REPLACE_WITH_YOUR_COMPOSER_JAX_IMAGE"


def _run_config(argv: list[str]) -> Config:
    """The config `composer-jax rl ARGS` runs (argv from `composer-jax` on), as rl/cli.py builds it:
    the real parser and rl/cli.py's overrides. The recipes place the services (rl.placement=ray), not
    the trainer (no --placement ray): it is the driver, on the head."""
    assert argv[:2] == ["composer-jax", "rl"], argv
    args = _rl_parser().parse_args(argv[2:])
    assert args.placement is None and "rl.placement=ray" in args.overrides, argv
    config = Path(args.config)
    assert not config.is_absolute() and config.parts[0] == "configs", config  # the checkout's, run from its root
    assert (ROOT / config).is_file(), config
    cfg = load_config(ROOT / config, [*args.overrides, *placement_overrides(args, rl=True)], num_devices=None)
    assert cfg.train.placement == "local"
    return cfg


def _fleet(cfg: Config) -> dict[str, Any]:
    """What the run asks Ray for on GPUs; the mesh's -1 axis takes one device, as `inspect` sizes it."""
    devices = math.prod(getattr(cfg.mesh, a) for a in MESH_AXES if getattr(cfg.mesh, a) != -1)
    return ray_resources(cfg, devices, "gpu")


# --------------------------------------------------------------------------------------------------
# KubeRay RayJob
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rayjob() -> dict[str, Any]:
    return yaml.safe_load(RAYJOB.read_text())


def _custom_resources(start_params: dict[str, Any]) -> dict[str, float]:
    """rayStartParams.resources in KubeRay's documented form, `'"{\\"Custom1\\": 1}"'` in YAML: the
    string is a double-quoted JSON string (the backslashes are literal) holding a JSON object."""
    if "resources" not in start_params:
        return {}
    value = start_params["resources"]
    assert isinstance(value, str) and value.startswith('"{') and value.endswith('}"'), value
    inner = json.loads(value)  # the quoted string, as the shell of `ray start --resources=...` unquotes it
    resources = json.loads(inner)
    assert isinstance(resources, dict) and all(isinstance(v, int | float) for v in resources.values()), inner
    assert not {"CPU", "GPU", "memory"} & set(resources)  # KubeRay: custom resources only
    return resources


def _container(group: dict[str, Any]) -> dict[str, Any]:
    containers = group["template"]["spec"]["containers"]
    assert isinstance(containers, list) and containers, group
    c = containers[0]
    assert isinstance(c["name"], str) and c["image"] == IMAGE_PLACEHOLDER, c
    return c


def _gpus(group: dict[str, Any]) -> int:
    resources = _container(group).get("resources", {})
    limit = resources.get("limits", {}).get("nvidia.com/gpu")
    if limit is None:
        return 0
    assert resources["requests"]["nvidia.com/gpu"] == limit  # extended resources: request equals limit
    return int(limit)


def _ray_gpus(group: dict[str, Any]) -> int:
    """The GPUs the pod's `ray start` offers Ray: rayStartParams' num-gpus when set, else (KubeRay) the
    container's nvidia.com/gpu limit."""
    params = group["rayStartParams"]
    return int(params["num-gpus"]) if "num-gpus" in params else _gpus(group)


def test_the_rayjob_is_a_rayjob_of_the_run(rayjob):
    assert rayjob["apiVersion"] == "ray.io/v1" and rayjob["kind"] == "RayJob"
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", rayjob["metadata"]["name"])  # a DNS-1123 label
    spec = rayjob["spec"]
    assert spec["shutdownAfterJobFinishes"] is True and isinstance(spec["ttlSecondsAfterFinished"], int)
    cfg = _run_config(shlex.split(spec["entrypoint"]))
    assert cfg.rl.placement == "ray" and cfg.rl.ray.address == ""  # RAY_ADDRESS from the job submission
    cluster = spec["rayClusterSpec"]
    assert cluster["rayVersion"] == "2.60.0" == _pins_ray()
    head = cluster["headGroupSpec"]
    assert all(isinstance(v, str) for v in head["rayStartParams"].values())  # KubeRay takes strings
    assert {p["containerPort"] for p in _container(head)["ports"]} >= {6379, 8265, 10001}


def _pins_ray() -> str:
    (line,) = [ln for ln in (ROOT / "locks" / "ray.lock").read_text().splitlines() if ln.startswith("ray==")]
    return line.split("==")[1].split()[0]


def test_the_rayjobs_worker_groups_hold_the_runs_fleet(rayjob):
    groups = rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    names = [g["groupName"] for g in groups]
    assert len(set(names)) == len(names) and all(re.fullmatch(r"[a-z0-9-]+", n) for n in names)
    for g in groups:
        for key in ("replicas", "minReplicas", "maxReplicas"):
            assert isinstance(g[key], int) and not isinstance(g[key], bool), (g["groupName"], key)
        assert 0 <= g["minReplicas"] <= g["replicas"] <= g["maxReplicas"], g["groupName"]
        assert all(isinstance(v, str) for v in g["rayStartParams"].values()), g["groupName"]
        mounts = {m["name"] for m in _container(g).get("volumeMounts", [])}
        assert {v["name"] for v in g["template"]["spec"]["volumes"]} >= mounts
    by_name = {g["groupName"]: g for g in groups}
    # the trainer is the driver, on the head: no worker group of its own
    assert set(by_name) == {"env-servers", "samplers"}
    cfg = _run_config(shlex.split(rayjob["spec"]["entrypoint"]))
    fleet = _fleet(cfg)
    env, rep = fleet["env_servers"], fleet["replicas"]

    # the CPU group: the env_server resource, no GPU, room for every environment server
    cpu = by_name["env-servers"]
    units = _custom_resources(cpu["rayStartParams"])
    assert set(units) == {cfg.rl.ray.env_server_resource} == {"env_server"} and _gpus(cpu) == 0
    assert cpu["replicas"] * units["env_server"] >= env["count"] == 4
    assert float(_container(cpu)["resources"]["limits"]["cpu"]) >= units["env_server"] * env["cpus"]

    # the GPU group of the replicas: nvidia.com/gpu and the sampler resource, a replica's GPUs each
    samplers = by_name["samplers"]
    units = _custom_resources(samplers["rayStartParams"])
    assert set(units) == {cfg.rl.ray.sampler_resource} == {"sampler"}
    assert samplers["replicas"] * units["sampler"] >= rep["count"] == 2
    assert _gpus(samplers) >= units["sampler"] * rep["gpus"] > 0
    tolerations = samplers["template"]["spec"]["tolerations"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations

    # what Ray is offered covers what it is asked for; the env-servers group offers no GPU
    assert _ray_gpus(cpu) == 0 and samplers["replicas"] * _ray_gpus(samplers) >= fleet["totals"]["gpus"] == 2


def test_the_rayjobs_head_holds_the_trainer_and_gives_ray_none_of_it(rayjob):
    # Ray Jobs run the entrypoint, the driver, on the head pod: the trainer's GPUs are the head's
    cfg = _run_config(shlex.split(rayjob["spec"]["entrypoint"]))
    trainer = _fleet(cfg)["trainer"]
    assert trainer["placed_by_ray"] is False and trainer["hosts"] == 1
    head = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]
    assert _gpus(head) >= trainer["devices_per_host"] == 1
    tolerations = head["template"]["spec"]["tolerations"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations
    # ... and Ray is offered none of them, no CPU and no custom resource: no actor lands on the head
    params = head["rayStartParams"]
    assert (params["num-gpus"], params["num-cpus"]) == ("0", "0") and _ray_gpus(head) == 0
    assert _custom_resources(params) == {}


def test_the_rayjob_names_its_image_placeholder_and_no_other_image(rayjob):
    text = RAYJOB.read_text()
    images = re.findall(r"^\s*image:\s*(\S+)", text, re.M)
    assert images and set(images) == {IMAGE_PLACEHOLDER}
    assert "REPLACE_WITH_YOUR_COMPOSER_JAX_IMAGE" in text.split("apiVersion")[0]  # the header says what to put


# --------------------------------------------------------------------------------------------------
# Ray on Slurm
# --------------------------------------------------------------------------------------------------

# sbatch options the script may use (sbatch(1)); a site adds --partition / --account
SBATCH_OPTIONS = {
    "job-name",
    "time",
    "output",
    "nodes",
    "ntasks-per-node",
    "cpus-per-task",
    "gpus-per-node",
    "exclusive",
    "partition",
    "account",
}


def _sbatch_components() -> list[dict[str, str]]:
    """The #SBATCH options of each heterogeneous-job component, in order (`#SBATCH hetjob` separates
    them); sbatch reads them only before the script's first command, so every one must be there."""
    lines = SBATCH.read_text().splitlines()
    first_command = next(i for i, ln in enumerate(lines) if ln.strip() and not ln.startswith("#"))
    assert not [ln for ln in lines[first_command:] if ln.startswith("#SBATCH")]
    components: list[dict[str, str]] = [{}]
    for ln in lines[:first_command]:
        if not ln.startswith("#SBATCH"):
            continue
        option = ln.split(None, 1)[1].strip()
        if option == "hetjob":
            components.append({})
            continue
        m = re.fullmatch(r"--([a-z-]+)(?:=(\S+))?", option)
        assert m and m.group(1) in SBATCH_OPTIONS, ln
        assert m.group(1) not in components[-1], ln
        components[-1][m.group(1)] = m.group(2) or ""
    return components


def _default(name: str) -> str:
    m = re.search(rf"^{name}=\$\{{{name}:-([^}}]+)\}}", SBATCH.read_text(), re.M)
    assert m, name
    return m.group(1)


def test_the_sbatch_script_parses_and_asks_for_two_node_kinds():
    out = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert SBATCH.read_text().startswith("#!/bin/bash\n")
    gpu, cpu = _sbatch_components()
    for component in (gpu, cpu):
        assert int(component["nodes"]) >= 1 and component["ntasks-per-node"] == "1"  # one `ray start` a node
        assert int(component["cpus-per-task"]) >= 1 and "exclusive" in component
    assert gpu["gpus-per-node"] == _default("GPUS_PER_NODE") and "gpus-per-node" not in cpu
    assert re.fullmatch(r"\d+:\d\d:\d\d", gpu["time"]) and gpu["job-name"]


def _stub(bin_dir: Path, name: str, body: str = "") -> None:
    """A stand-in command that appends its name and arguments (0x1f after each, 0x1e after the call) to
    $STUB_LOG, in one write: the script starts some in the background, and their records must not mix."""
    path = bin_dir / name
    record = f'record=$(printf "%s\\x1f" {name} "$@")\nprintf "%s\\x1e" "$record" >> "$STUB_LOG"\n'
    path.write_text(f"#!/bin/bash\n{record}{body}")
    path.chmod(0o755)


def _run_sbatch(tmp_path: Path, alive: int, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, list]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    _stub(bin_dir, "scontrol", 'echo "$3" | tr , "\\n"\n')  # scontrol show hostnames LIST
    _stub(bin_dir, "hostname", "echo 10.1.2.3 fd00::3\n")
    for name in ("srun", "composer-jax"):
        _stub(bin_dir, name)
    _stub(bin_dir, "python-stub", f"echo {alive}\n")  # the alive-node count the wait asks Ray for
    log = tmp_path / "calls.log"
    log.unlink(missing_ok=True)
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "RAY_"))}
    environ.update(
        PATH=f"{bin_dir}:{environ['PATH']}",
        STUB_LOG=str(log),
        PYTHON=str(bin_dir / "python-stub"),
        SLURM_JOB_NODELIST_HET_GROUP_0="gpu7,gpu8,gpu9",
        SLURM_JOB_NODELIST_HET_GROUP_1="cpu1,cpu2",
        SLURM_CPUS_PER_TASK_HET_GROUP_0="32",
        SLURM_CPUS_PER_TASK_HET_GROUP_1="64",
        SLURMD_NODENAME="gpu7",
        **env,
    )
    out = subprocess.run(
        ["bash", str(SBATCH), *args], cwd=ROOT, env=environ, capture_output=True, text=True, timeout=60
    )
    calls = [c.split("\x1f")[:-1] for c in log.read_text().split("\x1e")[:-1]] if log.exists() else []
    return out, calls


def _ray_start(call: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    """(srun's options, ray start's options) of an `srun ... ray start ...` call."""
    i = call.index("ray")
    assert call[i + 1] == "start", call
    opts = lambda words: dict(w[2:].split("=", 1) if "=" in w else (w[2:], "") for w in words)  # noqa: E731
    return opts(call[1:i]), opts(call[i + 2 :])


def test_the_sbatch_script_starts_ray_by_node_kind_and_then_the_run(tmp_path):
    out, calls = _run_sbatch(tmp_path, 5, "rl.env_servers=8", SAMPLERS_PER_NODE="3", ENV_SERVERS_PER_NODE="4")
    assert out.returncode == 0, out.stdout + out.stderr
    starts = [_ray_start(c) for c in calls if c[0] == "srun"]
    address = "10.1.2.3:6379"  # the head's first address, the GCS port
    head = [(s, r) for s, r in starts if "head" in r]
    assert len(head) == 1 and len(starts) == 3
    srun, ray = head[0]
    assert srun["het-group"] == "0" and srun["nodelist"] == "gpu7"  # the node the script runs on
    # the head is the trainer's node (the driver runs on it, below): its Ray step takes none of its GPUs,
    # and Ray is offered no GPU, no CPU and no `sampler` there, so no actor is placed on it
    assert srun["gres"] == "none" and "gpus-per-node" not in srun and srun["cpus-per-task"] == "32"
    assert (ray["num-gpus"], ray["num-cpus"]) == ("0", "0") and "resources" not in ray
    assert ray["node-ip-address"] == "10.1.2.3" and ray["port"] == "6379" and "block" in ray
    workers = {s["nodelist"]: (s, r) for s, r in starts if "head" not in r}
    # every other GPU node holds replicas, in one step; the CPU nodes the environment servers
    assert set(workers) == {"gpu8,gpu9", "cpu1,cpu2"}
    for nodes, (srun, ray) in workers.items():
        n = len(nodes.split(","))
        assert (srun["nodes"], srun["ntasks"], srun["ntasks-per-node"]) == (str(n), str(n), "1")
        assert ray["address"] == address and "block" in ray
    srun, ray = workers["gpu8,gpu9"]
    assert (srun["het-group"], srun["gpus-per-node"], srun["cpus-per-task"]) == ("0", "8", "32")
    assert json.loads(ray["resources"]) == {"sampler": 3} and (ray["num-gpus"], ray["num-cpus"]) == ("8", "32")
    srun, ray = workers["cpu1,cpu2"]
    assert (srun["het-group"], srun["cpus-per-task"], "gpus-per-node" in srun) == ("1", "64", False)
    assert json.loads(ray["resources"]) == {"env_server": 4} and ray["num-gpus"] == "0"

    # the run, on the head, last: the default config with the script's arguments as overrides
    (run,) = [c for c in calls if c[0] == "composer-jax"]
    waits = [i for i, c in enumerate(calls) if c[0] == "python-stub"]
    assert len(waits) == 2 and calls.index(run) > waits[-1]  # after the head, then all 5 nodes, were alive
    assert [c[1:] for c in calls if c[0] == "python-stub"][0][-1] == address
    assert run[1:] == ["rl", "--config", "configs/rl/cluster_example.yaml", "rl.placement=ray"] + [
        "rl.ray.address=auto",
        "rl.env_servers=8",
    ]
    cfg = _run_config(run)
    assert cfg.rl.ray.address == "auto" and cfg.rl.env_servers == 8


def test_the_sbatch_scripts_defaults_hold_the_example_runs_fleet(tmp_path):
    out, calls = _run_sbatch(tmp_path, 5)
    assert out.returncode == 0, out.stdout + out.stderr
    (run,) = [c for c in calls if c[0] == "composer-jax"]
    fleet = _fleet(_run_config(run))
    gpu, cpu = _sbatch_components()
    per_node = int(_default("SAMPLERS_PER_NODE"))
    rep = fleet["replicas"]
    # the replicas go on the GPU nodes but the head: a unit of `sampler` per replica, their GPUs on a node
    assert (int(gpu["nodes"]) - 1) * per_node >= rep["count"] == 2
    assert per_node * rep["gpus"] <= int(gpu["gpus-per-node"])
    # the trainer is the driver, on the head, one host: its GPUs are the head's, not Ray's
    trainer = fleet["trainer"]
    assert trainer["placed_by_ray"] is False and trainer["hosts"] == 1
    assert trainer["devices_per_host"] <= int(gpu["gpus-per-node"])
    assert (int(gpu["nodes"]) - 1) * int(gpu["gpus-per-node"]) >= fleet["totals"]["gpus"]
    env = fleet["env_servers"]
    assert int(cpu["nodes"]) * int(_default("ENV_SERVERS_PER_NODE")) >= env["count"] == 4
    assert int(cpu["cpus-per-task"]) >= int(_default("ENV_SERVERS_PER_NODE")) * env["cpus"]


def test_the_sbatch_script_gives_up_on_nodes_that_do_not_join(tmp_path):
    out, calls = _run_sbatch(tmp_path, 2, WAIT_S="0")  # 2 of the 5 nodes alive, no time to wait
    assert out.returncode == 1
    assert "fewer than 5 Ray nodes alive at 10.1.2.3:6379 after 0s" in out.stderr
    assert not [c for c in calls if c[0] == "composer-jax"]
    # outside a heterogeneous job it says what it needs before starting anything
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    out = subprocess.run(["bash", str(SBATCH)], cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=30)
    assert out.returncode != 0 and "run this script with sbatch" in out.stderr
