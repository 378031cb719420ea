"""``python -m dllm_serve_train.tiny_checkpoints``: see
:func:`dllm_serve_train.tiny_checkpoints.main`."""

from dllm_serve_train.tiny_checkpoints import main

raise SystemExit(main())
