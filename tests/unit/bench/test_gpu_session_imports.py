"""What ``scripts/gpu_session.sh`` runs on a lent GPU needs only what that machine has.

The lent machine has torch, transformers, safetensors, numpy and pytest, but none of the API's
dependencies (FastAPI, pydantic, uvicorn, the openai SDK); uuid6 is carried as a wheel. A GPU
window is short and rare, so a GPU-marked test file or a benchmark that starts importing the
API would waste it. Here those modules are made unimportable, as they are there, and the
script's benchmarks are imported and its GPU test files collected.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
# Installed here (runtime or dev dependencies), absent on the lent GPU machine.
ABSENT_THERE = (
    "fastapi", "fastapi_offline", "uvicorn", "pydantic", "pydantic_core", "starlette",
    "sse_starlette", "openai", "schemathesis", "websockets",
)  # fmt: skip
GPU_MARK = re.compile(r"mark\.gpu\b")  # the script selects files with `grep -rlE "mark\.gpu\b"`


def gpu_test_files() -> list[str]:
    return sorted(
        str(path.relative_to(ROOT))
        for path in (ROOT / "tests").rglob("*.py")
        if GPU_MARK.search(path.read_text())
    )


def run_without_api(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python args`` from the repository root with the API's modules unimportable."""
    for name in ABSENT_THERE:
        (tmp_path / f"{name}.py").write_text(f"raise ImportError('{name} is not installed')\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT / "src")])
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # this venv's plugins are not there either
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def test_the_script_selects_the_gpu_test_files_this_way() -> None:
    script = (ROOT / "scripts" / "gpu_session.sh").read_text()
    assert 'grep -rlE "mark\\.gpu\\b" tests' in script
    assert "pytest $gpu_files -m gpu" in script
    assert "-o addopts=" in script  # no pytest-xdist there
    assert "tests/gpu/test_gpu_cuda_paths.py" in gpu_test_files()


def test_gpu_tests_collect_without_the_api_dependencies(tmp_path: Path) -> None:
    files = gpu_test_files()
    done = run_without_api(
        tmp_path, "-m", "pytest", *files, "-m", "gpu", "--collect-only", "-q",
        "-p", "no:cacheprovider", "-o", "addopts=",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    collected = re.search(r"(\d+)/\d+ tests collected|(\d+) tests? collected", done.stdout)
    assert collected is not None, done.stdout[-2000:]
    assert int(collected.group(1) or collected.group(2)) >= len(files)


def test_the_gpu_benchmarks_import_without_the_api_dependencies(tmp_path: Path) -> None:
    code = (
        "import sys; sys.path.insert(0, 'benchmarks'); "
        "import engine_overhead, gpu_llada8b, gpu_moe_layer, gpu_profile_step, graph_coverage; "
        "import dllm_serve.llm, dllm_serve.engine.engine; print('ok')"
    )
    done = run_without_api(tmp_path, "-c", code)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok"
    # The stubs do block: the API itself cannot be imported in that environment.
    blocked = run_without_api(tmp_path, "-c", "import dllm_serve.api.app")
    assert blocked.returncode != 0 and "is not installed" in blocked.stderr
