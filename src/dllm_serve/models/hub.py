"""Where a ``--model`` value points: an embedded checkpoint, a local directory, or a model id
already in the local Hugging Face cache.

Nothing is ever downloaded: this server runs offline (whether or not ``HF_HUB_OFFLINE`` is
set), so a model id must already be in the cache. The cache layout is huggingface_hub's:
``<cache>/models--<org>--<name>/refs/<revision>`` holds a commit hash and
``<cache>/models--<org>--<name>/snapshots/<hash>/`` the files.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from dllm_serve.models.errors import ModelLoadError

logger = logging.getLogger(__name__)

_ASSETS = Path(__file__).resolve().parent.parent / "assets"
# demo-llada / demo-idlm / demo-trimode: trained on the project's task mix (their README.md is
# the model card); tiny-llada: random weights, for tests.
EMBEDDED_MODELS: dict[str, str] = {
    name: str(_ASSETS / name) for name in ("demo-llada", "demo-idlm", "demo-trimode", "tiny-llada")
}
# Draft LoRAs shipped beside an embedded model (``--draft-lora NAME``).
EMBEDDED_ADAPTERS: dict[str, str] = {"demo-trimode-lora": str(_ASSETS / "demo-trimode/draft-lora")}

# huggingface_hub's repo id rule: optional "org/", then a name of letters, digits, - _ .
_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*$")


def hf_cache_dirs() -> list[Path]:
    """Hub cache directories to search, most specific first, read from the environment now
    (not at import, so a changed environment is honoured): ``HF_HUB_CACHE``,
    ``HUGGINGFACE_HUB_CACHE`` (older name), ``$HF_HOME/hub``, ``$XDG_CACHE_HOME/huggingface/hub``,
    ``~/.cache/huggingface/hub``."""
    env = os.environ
    candidates: list[str | Path] = []
    for key in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(key):
            candidates.append(env[key])
    if env.get("HF_HOME"):
        candidates.append(Path(env["HF_HOME"]) / "hub")
    elif env.get("XDG_CACHE_HOME"):
        candidates.append(Path(env["XDG_CACHE_HOME"]) / "huggingface" / "hub")
    else:
        candidates.append(Path.home() / ".cache" / "huggingface" / "hub")
    out: list[Path] = []
    for c in candidates:
        p = Path(c).expanduser()
        if p not in out:
            out.append(p)
    return out


def _snapshot(repo_dir: Path, revision: str) -> Path | None:
    """The snapshot directory of ``revision`` (a ref name or a commit hash) in one repo."""
    snapshots = repo_dir / "snapshots"
    ref = repo_dir / "refs" / revision
    if ref.is_file():
        commit = ref.read_text(encoding="utf-8").strip()
        return snapshots / commit if (snapshots / commit).is_dir() else None
    if (snapshots / revision).is_dir():
        return snapshots / revision
    if revision == "main" and snapshots.is_dir():
        # No refs/main (e.g. files copied in by hand): use the newest snapshot there is.
        found = sorted((d for d in snapshots.iterdir() if d.is_dir()), key=os.path.getmtime)
        if found:
            if len(found) > 1:
                logger.warning("%s has no refs/main; using newest snapshot %s", repo_dir, found[-1])
            return found[-1]
    return None


def _looks_like_path(name: str) -> bool:
    """Whether ``name`` can only be a filesystem path, never a Hub model id: absolute, starting
    with ``.`` or ``~``, or with a path separator where an id has none (more than one ``/``,
    a backslash, a leading or trailing ``/``)."""
    if name.startswith((".", "~")) or Path(name).is_absolute():
        return True
    return not _REPO_ID.match(name)


def resolve_model_path(name_or_path: str, revision: str | None = None) -> Path:
    """An embedded model name, a local checkpoint directory, or a cached HF model id -> its
    directory. Raises :class:`ModelLoadError` naming every place that was tried."""
    if name_or_path in EMBEDDED_MODELS:
        return Path(EMBEDDED_MODELS[name_or_path])
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ModelLoadError(f"model {name_or_path!r}: {path.resolve()} is not a directory")
    embedded = f"Embedded models: {', '.join(sorted(EMBEDDED_MODELS))}"
    if _looks_like_path(name_or_path):
        raise ModelLoadError(
            f"model {name_or_path!r}: directory {path.resolve()} does not exist. Pass a "
            f"checkpoint directory (config.json, tokenizer files, *.safetensors), a model id "
            f"already in the Hugging Face cache, or an embedded model. {embedded}"
        )
    tried = [f"no directory at {path.resolve()}"]
    folder = "models--" + name_or_path.replace("/", "--")
    rev = revision or "main"
    for cache in hf_cache_dirs():
        snap = _snapshot(cache / folder, rev)
        if snap is not None:
            if not (snap / "config.json").is_file():
                raise ModelLoadError(
                    f"model {name_or_path!r}: cached snapshot {snap} has no config.json "
                    "(an incomplete download?)"
                )
            return snap
        tried.append(f"not in the Hugging Face cache at {cache / folder} (revision {rev})")
    offline = os.environ.get("HF_HUB_OFFLINE", "unset")
    fetch = f"hf download {name_or_path}" + (f" --revision {revision}" if revision else "")
    raise ModelLoadError(
        f"model {name_or_path!r} not found: {'; '.join(tried)}. dllm-serve never downloads "
        f"(HF_HUB_OFFLINE={offline}); fetch the checkpoint into the cache first with "
        f"`{fetch}` (huggingface_hub's `hf` command), or pass a local directory. {embedded}"
    )
