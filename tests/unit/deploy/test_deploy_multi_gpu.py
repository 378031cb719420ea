"""docker/k8s-multi-gpu/llada2-flash-tp8.yaml — LLaDA2.0-flash over the 8 GPUs of one node
(tensor parallelism 8, expert parallelism 8) — keeps its promises.

No cluster or GPU here: PyYAML reads the manifest and the server's own CLI parser reads the
container's arguments, so a renamed or misspelt flag breaks this test rather than a
deployment. kubernetes-validate runs too when installed.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from manifests import flag_value, objects_by_kind

from dllm_serve.cli import build_parser, parse_config

ROOT = Path(__file__).resolve().parents[3]
MANIFEST = ROOT / "docker" / "k8s-multi-gpu" / "llada2-flash-tp8.yaml"
ONE_GPU_SERVICE = ROOT / "docker" / "k8s" / "service.yaml"
ONE_GPU_DEPLOYMENT = ROOT / "docker" / "k8s" / "deployment.yaml"
PORT = 8000
RANKS = 8
# After --shutdown-timeout: uvicorn's 5 s for leftover connections and the engine's stop
# (up to 10 s), as in test_deploy_files.py.
EXIT_MARGIN_S = 15
# Set by torchrun-style launchers; in this pod they would make rank 0 wait for 7 ranks that
# nobody starts (engine/parallel/rendezvous.py: multi_node_rank).
LAUNCHER_ENV = {"WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}


def objects(path: Path = MANIFEST) -> dict[str, dict[str, Any]]:
    """kind -> object; one object of each kind."""
    return objects_by_kind([path])


def pod_spec() -> dict[str, Any]:
    return objects()["Deployment"]["spec"]["template"]["spec"]


def container() -> dict[str, Any]:
    (only,) = pod_spec()["containers"]
    return only


def args() -> list[str]:
    return container()["args"]


def gibibytes(quantity: str) -> float:
    """A Kubernetes memory quantity with a binary suffix ("16Gi", "512Mi")."""
    match = re.fullmatch(r"(\d+)(Mi|Gi|Ti)", quantity)
    assert match, quantity
    return int(match.group(1)) * {"Mi": 1 / 1024, "Gi": 1, "Ti": 1024}[match.group(2)]


def test_the_manifest_holds_a_claim_a_deployment_and_a_service() -> None:
    assert sorted(objects()) == ["Deployment", "PersistentVolumeClaim", "Service"]
    assert objects()["Deployment"]["apiVersion"] == "apps/v1"


def test_every_flag_is_spelt_as_the_cli_defines_it() -> None:
    # argparse also accepts unambiguous abbreviations; a manifest should not rely on them.
    options = {s for action in build_parser()._actions for s in action.option_strings}
    flags = [a for a in args() if a.startswith("--")]
    assert flags and set(flags) <= options, set(flags) - options
    assert all(isinstance(a, str) for a in args())  # Kubernetes args are strings


def test_the_cli_reads_llada2_flash_over_8_ranks_with_8_way_expert_parallelism() -> None:
    model = parse_config(args()).model
    assert model.model == "/models/LLaDA2.0-flash"
    assert model.dtype == "bfloat16"
    assert model.tensor_parallel_size == RANKS
    assert model.expert_parallel_size == RANKS


def test_one_gpu_per_rank_and_no_launcher_environment() -> None:
    limits = container()["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == parse_config(args()).model.tensor_parallel_size
    assert {e["name"] for e in container()["env"]}.isdisjoint(LAUNCHER_ENV)
    # No surge: a second pod would need a second free 8-GPU node.
    assert objects()["Deployment"]["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0


def test_dev_shm_is_a_memory_volume_within_the_memory_limit() -> None:
    mounts = {m["mountPath"]: m for m in container()["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec()["volumes"]}
    shm = volumes[mounts["/dev/shm"]["name"]]["emptyDir"]
    assert shm["medium"] == "Memory"
    # Memory-backed: it counts against the container's memory limit, so it must fit in it.
    limit = gibibytes(container()["resources"]["limits"]["memory"])
    assert 1 <= gibibytes(shm["sizeLimit"]) < limit


def test_models_are_its_own_claim_mounted_read_only_and_big_enough() -> None:
    mounts = {m["mountPath"]: m for m in container()["volumeMounts"]}
    assert mounts["/models"]["readOnly"] is True
    volumes = {v["name"]: v for v in pod_spec()["volumes"]}
    claim = volumes[mounts["/models"]["name"]]["persistentVolumeClaim"]
    pvc = objects()["PersistentVolumeClaim"]
    assert claim == {"claimName": pvc["metadata"]["name"], "readOnly": True}
    # The one-GPU replicas' 50 Gi claim (docker/k8s/pvc.yaml) cannot hold ~200 GB of bf16.
    assert gibibytes(pvc["spec"]["resources"]["requests"]["storage"]) >= 200
    assert parse_config(args()).model.model.startswith("/models/")


def probe_budget(probe: dict[str, Any]) -> float:
    return probe["periodSeconds"] * probe["failureThreshold"]


def test_probes_ask_health_and_fit_a_200_gb_load_and_the_drain() -> None:
    ports = {p["name"]: p["containerPort"] for p in container()["ports"]}
    assert list(ports.values()) == [PORT]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container()[probe]["httpGet"]
        assert get["path"] == "/health", probe
        assert ports.get(get["port"], get["port"]) == PORT, probe
    shutdown = float(flag_value(args(), "--shutdown-timeout"))
    assert probe_budget(container()["startupProbe"]) >= 1800
    assert probe_budget(container()["livenessProbe"]) > shutdown
    assert probe_budget(container()["readinessProbe"]) <= 15
    pre_stop = container()["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    grace = pod_spec()["terminationGracePeriodSeconds"]
    assert grace >= float(pre_stop[1]) + shutdown + EXIT_MARGIN_S


def test_its_service_and_the_one_gpu_service_each_route_only_to_their_own_pods() -> None:
    service = objects()["Service"]["spec"]
    assert service["type"] == "ClusterIP"
    assert service["sessionAffinity"] == "None"  # any replica answers any request
    (port,) = service["ports"]
    assert port["port"] == PORT
    ports = {p["name"]: p["containerPort"] for p in container()["ports"]}
    assert ports.get(port["targetPort"], port["targetPort"]) == PORT
    labels = objects()["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert service["selector"].items() <= labels.items()
    one_gpu_selector = objects(ONE_GPU_SERVICE)["Service"]["spec"]["selector"]
    assert not one_gpu_selector.items() <= labels.items()
    one_gpu = objects(ONE_GPU_DEPLOYMENT)["Deployment"]["spec"]["template"]["metadata"]
    assert not service["selector"].items() <= one_gpu["labels"].items()


def test_pod_runs_as_the_images_non_root_user_without_privileges() -> None:
    pod = pod_spec()["securityContext"]
    one_gpu = objects(ONE_GPU_DEPLOYMENT)["Deployment"]["spec"]["template"]["spec"]
    assert pod["runAsNonRoot"] is True
    assert pod["runAsUser"] == one_gpu["securityContext"]["runAsUser"] != 0
    assert container()["securityContext"]["allowPrivilegeEscalation"] is False
    assert container()["securityContext"]["capabilities"]["drop"] == ["ALL"]
    env = {e["name"]: e for e in container()["env"]}
    assert env["DLLM_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "dllm-serve-api-key"
    assert "--api-key" not in args()


def test_the_deployment_doc_points_at_the_manifest() -> None:
    doc = (ROOT / "docs" / "deployment.md").read_text()
    assert "docker/k8s-multi-gpu/llada2-flash-tp8.yaml" in doc
    assert "kubectl apply -f docker/k8s-multi-gpu/llada2-flash-tp8.yaml" in doc


def test_the_manifest_validates_against_the_api_schemas() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    version = kubernetes_validate.latest_version()
    for doc in objects().values():
        kubernetes_validate.validate(doc, version, strict=True)
