"""The multi-host launch files: slurm.sbatch run under a stand-in for srun, the Kubernetes manifest
read as Kubernetes would give it to each pod, and the GPU XLA flags they share."""

import os
import signal
import subprocess
import sys

import pytest
import yaml
from conftest import REPO, fake_slurm_env

from t5scale.config import build_run_config, parse_gin
from t5scale.parallel.distributed import DistributedConfig, resolve_processes

LAUNCH = REPO / "launch"


def _gpu_flags() -> str:
    script = f'source {LAUNCH / "xla_gpu_flags.sh"}; printf %s "$T5SCALE_XLA_GPU_FLAGS"'
    return subprocess.run(["bash", "-c", script], check=True, capture_output=True, text=True).stdout


def test_slurm_sbatch_starts_a_cluster_with_the_gpu_flags(tmp_path):
    env = fake_slurm_env(tmp_path)
    env |= {
        "SLURM_JOB_ID": "31337", "SLURM_NTASKS": "2", "SLURM_JOB_NUM_NODES": "1",
        "SLURM_SUBMIT_DIR": str(REPO), "T5SCALE_PYTHON": sys.executable,
        "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "",
    }  # fmt: skip
    process = subprocess.Popen(
        ["bash", str(LAUNCH / "slurm.sbatch"), "t5scale", "distributed-check", "--cpu_devices=2"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = process.communicate(timeout=120)
    except subprocess.TimeoutExpired:  # a hang: stop every process of the job, say where it was
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"the job did not end within 120 s; its output:\n{output[-3000:]}")
    # jaxlib aborts on an XLA flag it does not know: these GPU flags all exist in this version.
    assert process.returncode == 0, output
    assert f"XLA_FLAGS= {_gpu_flags()}" in output
    for i in (0, 1):
        assert f"process {i}/2 (slurm)" in output
        assert f"process {i}: distributed ok: 2 processes, 4 devices" in output


def test_kubernetes_manifest_gives_each_pod_its_place():
    service, job = yaml.safe_load_all((LAUNCH / "k8s" / "t5scale-job.yaml").read_text())
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    nodes = int(env["T5SCALE_NUM_PROCESSES"])
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == nodes
    # Pod 0 of an Indexed Job is <job>-0, and the headless Service named by `subdomain` gives it
    # the DNS name <job>-0.<service>.
    assert pod["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    port = service["spec"]["ports"][0]["port"]
    assert env["T5SCALE_COORDINATOR_ADDRESS"] == (
        f"{job['metadata']['name']}-0.{service['metadata']['name']}:{port}"
    )
    assert env["XLA_FLAGS"] == _gpu_flags()
    last = resolve_processes(DistributedConfig(), env | {"JOB_COMPLETION_INDEX": str(nodes - 1)})
    assert (last.source, last.process_id, last.num_processes) == ("kubernetes", nodes - 1, nodes)
    # The pod's command line is a t5scale run whose gin files exist and bind.
    assert container["command"][-1] == "t5scale.cli" and container["args"][0] == "train"
    files = [a.split("=", 1)[1] for a in container["args"] if a.startswith("--gin_file=")]
    bindings = [a.removeprefix("--gin.") for a in container["args"] if a.startswith("--gin.")]
    parse_gin(files, bindings)
    assert build_run_config().train.model_dir.startswith("/runs/")


def test_local_sh_usage_error():
    result = subprocess.run([str(LAUNCH / "local.sh"), "two", "train"], capture_output=True)
    assert result.returncode == 2
    assert b"usage: launch/local.sh N" in result.stderr


def test_compile_only_gpu_programs_use_the_launch_flags():
    """A compile-only GPU program (plan, simulate) is compiled as a launched job's would be."""
    from t5scale.xla_gpu import LAUNCH_FLAGS

    flags = dict(flag.removeprefix("--").split("=") for flag in _gpu_flags().split())
    assert flags == {name: str(value).lower() for name, value in LAUNCH_FLAGS.items()}
