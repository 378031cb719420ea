"""dllm-serve: an OpenAI-compatible serving engine for diffusion LLMs."""

__version__ = "0.1.0"
