"""``python -m dllm_serve.models.tiny``: see :func:`dllm_serve.models.tiny.main`."""

from dllm_serve.models.tiny import main

raise SystemExit(main())
