"""dllm-serve: an OpenAI-compatible serving engine for diffusion LLMs.

``LLM`` (with its ``Completion``, ``InvalidRequestError`` and ``EngineDeadError``) and
``DecodingParams`` are
imported lazily so that ``import dllm_serve`` (and the
CLI's ``--help``) does not pay for torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dllm_serve.version import __version__

__all__ = [
    "LLM",
    "Completion",
    "DecodingParams",
    "EngineDeadError",
    "InvalidRequestError",
    "__version__",
]

if TYPE_CHECKING:
    from dllm_serve.decoding.params import DecodingParams
    from dllm_serve.llm import LLM, Completion, EngineDeadError, InvalidRequestError


def __getattr__(name: str) -> Any:
    if name in ("LLM", "Completion", "EngineDeadError", "InvalidRequestError"):
        from dllm_serve import llm

        return getattr(llm, name)
    if name == "DecodingParams":
        from dllm_serve.decoding.params import DecodingParams

        return DecodingParams
    raise AttributeError(name)
