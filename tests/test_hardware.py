"""One hardware interface for the what-if wing (t5scale/whatif/hardware.py): a GPU cluster and a
TPU pod answer the same questions, and nothing outside their modules asks which it holds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import cli_inline

from t5scale.config import build_hardware, parse_gin
from t5scale.startup import cuda_plugin_installed, libtpu_installed
from t5scale.whatif.hardware import Hardware

PACKAGE = Path(__file__).resolve().parents[1] / "t5scale"
KINDS = {"gpu_cluster.py", "tpu_pod.py"}
TINY = ["--gin_file=gin/models/mt5_tiny.gin", "--gin.INPUT_LENGTH=32", "--gin.TARGET_LENGTH=8"]


def members(protocol: type) -> set[str]:
    names = set(getattr(protocol, "__annotations__", {}))
    return names | {
        name for name, value in vars(protocol).items()
        if not name.startswith("_") and (callable(value) or isinstance(value, property))
    }  # fmt: skip


def hardware_of(cluster_file: str, *bindings: str) -> Hardware:
    parse_gin([cluster_file], list(bindings))
    return build_hardware(required=True)


@pytest.mark.parametrize("cluster_file", ["gin/clusters/h100.gin", "gin/clusters/tpu_v5e.gin"])
def test_each_kind_answers_every_question(cluster_file):
    hardware = hardware_of(cluster_file)
    missing = {name for name in members(Hardware) if not hasattr(hardware, name)}
    assert missing == set() and len(members(Hardware)) >= 14
    assert hardware.memory_budget_bytes == int(hardware.device_memory_gb * 1e9)
    assert hardware.group_words(2).startswith("2 ")


@pytest.mark.skipif(not (cuda_plugin_installed() and libtpu_installed()), reason="needs both")
def test_both_kinds_give_targets_and_groups_for_the_same_questions():
    gpus = hardware_of("gin/clusters/h100.gin")
    pod = hardware_of("gin/clusters/tpu_v5e.gin", "TpuPodConfig.slice='v5e-8'")
    for hardware, word in ((gpus, "xla:gpu"), (pod, "xla:tpu")):
        two = hardware.group_target(2)
        assert two.size == 16 and two.dcn_groups == 2 and two.compile_only
        assert two.compiler_name.startswith(word)
        assert hardware.target(16).size == 16 and hardware.dcn_groups(16) in (1, 2)
    assert gpus.named_target() is None and pod.named_target().size == 8
    assert (gpus.timing_path(gpus.group_target(1)), pod.timing_path(pod.group_target(1))) == (
        "gpu",
        "tpu",
    )


def test_nothing_outside_the_hardware_modules_asks_which_kind_it_holds():
    asks = re.compile(r"isinstance\([^)]*(ClusterConfig|TpuPodConfig)")
    found = [
        f"{path.relative_to(PACKAGE)}:{number}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name not in KINDS
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if asks.search(line)
    ]
    assert found == []


def test_a_tpu_pod_refuses_a_gpu_clusters_compiler_choice_in_one_line(capsys, monkeypatch):
    code, _, err = cli_inline(
        ["simulate", *TINY, "--gin_file=gin/precision/mixed.gin",
         "--gin.ModelConfig.dtype='bfloat16'", "--gin_file=gin/clusters/tpu_v5e.gin",
         "--gin.SimulateConfig.compiler='cpu'"], capsys, monkeypatch,
    )  # fmt: skip
    assert code == 2 and err.strip().splitlines() == [
        "t5scale: error: SimulateConfig.compiler='cpu' applies to GPU clusters; a TPU pod's "
        "programs are XLA:TPU's"
    ]
