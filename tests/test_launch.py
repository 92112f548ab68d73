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
        "SLURM_CPUS_ON_NODE": "16", "SLURM_SUBMIT_DIR": str(REPO),
        "T5SCALE_PYTHON": sys.executable, "JAX_PLATFORMS": "cpu",
        # the user's own flag: after the launch flags, so that XLA keeps it over theirs
        "XLA_FLAGS": "--xla_gpu_all_reduce_combine_threshold_bytes=1024",
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
    assert f"XLA_FLAGS={_gpu_flags()} --xla_gpu_all_reduce_combine_threshold_bytes=1024" in output
    # two tasks on the node: each half of its 16 CPUs
    assert "srun --kill-on-bad-exit=1 --label --cpus-per-task=8" in output
    for i in (0, 1):
        assert f"process {i}/2 (slurm)" in output
        assert f"process {i}: distributed ok: 2 processes, 4 devices" in output


def test_kubernetes_manifest_gives_each_pod_its_place():
    service, job = yaml.safe_load_all((LAUNCH / "k8s" / "t5scale-job.yaml").read_text())
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    # pods on one node are one host of the mesh (t5scale/parallel/distributed.py host_name)
    node = [e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"] if "valueFrom" in e]
    assert [e["name"] for e in container["env"] if "valueFrom" in e] == ["T5SCALE_HOST"]
    assert node == ["spec.nodeName"]
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


FAKE_METADATA = """#!/usr/bin/env bash
# curl as a TPU VM's metadata server answers it: the last argument is the attribute's URL
case "${@: -1}" in
  */agent-worker-number) echo -n "$TPU_WORKER" ;;
  */worker-network-endpoints) [[ -n ${TPU_ENDPOINTS:-} ]] || exit 22; echo -n "$TPU_ENDPOINTS" ;;
  */tpu-env) [[ -n ${TPU_ENV:-} ]] || exit 22; printf "$TPU_ENV" ;;
  *) exit 22 ;;
esac
"""


def test_tpu_vm_sh_starts_every_worker_and_each_finds_its_place(tmp_path):
    """From your machine: one `gcloud … ssh --worker=all` with this script as the command, and
    the settings made here carried in it. On each worker (its metadata stood in for by a fake
    curl): the place t5scale joins from. Two workers on 127.0.0.1 then run distributed-check as
    one JAX run; a multislice's numbering comes from the MEGASCALE_* settings, in the
    environment or in the VM's tpu-env metadata, and every slice is reached through its queued
    resource."""
    env = fake_slurm_env(tmp_path)  # no SLURM or T5SCALE_ variables; a free port
    gcloud, curl = tmp_path / "gcloud", tmp_path / "curl"
    gcloud.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$GCLOUD_ARGS"\n')
    curl.write_text(FAKE_METADATA)
    for script in (gcloud, curl):
        script.chmod(0o755)
    outer = env | {"T5SCALE_GCLOUD": str(gcloud), "GCLOUD_ARGS": str(tmp_path / "args"),
                   "T5SCALE_REMOTE_DIR": str(REPO), "T5SCALE_PYTHON": sys.executable}  # fmt: skip
    command = ["t5scale", "distributed-check", "--cpu_devices=2"]
    script = ["bash", str(LAUNCH / "tpu_vm.sh"), "my-tpu", "us-east5-a", *command]
    subprocess.run(script, env=outer, check=True)
    *call, remote = (tmp_path / "args").read_text().splitlines()
    assert call == ["compute", "tpus", "tpu-vm", "ssh", "my-tpu", "--zone=us-east5-a",
                    "--worker=all"]  # fmt: skip
    assert remote.startswith("--command=")
    remote = remote.removeprefix("--command=")
    # The workers' environment has neither the port nor the interpreter: the command brings them.
    port = env["T5SCALE_COORDINATOR_PORT"]
    worker_env = {k: v for k, v in env.items() if k != "T5SCALE_COORDINATOR_PORT"}
    worker_env |= {"T5SCALE_CURL": str(curl), "TPU_ENDPOINTS": "w-0:0:127.0.0.1,w-1:1:127.0.0.2",
                   "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}  # fmt: skip
    workers = [
        subprocess.Popen(
            ["bash", "-c", remote],
            env=worker_env | {"TPU_WORKER": str(i)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for i in (0, 1)
    ]
    outputs = [worker.communicate(timeout=120)[0] for worker in workers]
    for i, (worker, output) in enumerate(zip(workers, outputs, strict=True)):
        assert worker.returncode == 0, output
        assert f"process {i}/2, coordinator 127.0.0.1:{port}" in output
        assert f"process {i}: distributed ok: 2 processes, 4 devices" in output

    def on_worker(**settings: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", str(LAUNCH / "tpu_vm.sh"), "distributed-check"], capture_output=True,
            env=worker_env | {"T5SCALE_ON_TPU_WORKER": "1", "T5SCALE_PYTHON": "false"} | settings,
            text=True,
        )  # fmt: skip

    # A multislice: the second slice's workers come after the first's, one coordinator; its
    # settings in the environment, or only in the VM's metadata (a process started over ssh).
    megascale = {"MEGASCALE_NUM_SLICES": "2", "MEGASCALE_SLICE_ID": "1",
                 "MEGASCALE_COORDINATOR_ADDRESS": "10.0.0.7"}  # fmt: skip
    tpu_env = "".join(f"{key}: '{value}'  \\n" for key, value in megascale.items())
    for settings in (megascale, {"TPU_ENV": f"ACCELERATOR_TYPE: 'v5p-16'\\n{tpu_env}"}):
        said = on_worker(TPU_WORKER="1", **settings)
        assert "process 3/4, coordinator 10.0.0.7:8482" in said.stdout, said.stdout + said.stderr
    # A metadata server that does not name the slice's workers: one line, exit 2.
    lost = on_worker(TPU_WORKER="0", TPU_ENDPOINTS="")
    assert lost.returncode == 2 and "cannot read this slice's workers" in lost.stderr
    # Every slice of a multislice: through the queued resource that made them.
    queued = outer | {"T5SCALE_QUEUED_RESOURCE": "1"}
    subprocess.run([*script[:2], "my-qr", *script[3:]], env=queued, check=True)
    *call, _ = (tmp_path / "args").read_text().splitlines()
    assert call == ["compute", "tpus", "queued-resources", "ssh", "my-qr", "--zone=us-east5-a",
                    "--node=all", "--worker=all", "--batch-size=all"]  # fmt: skip
