"""The model layer: per-family rules, one decoder transformer, the KV pool, checkpoint loading.

Read in import order: ``rope`` → ``kv_pool`` → ``attention`` → ``transformer`` → ``families``
→ ``hub`` / ``memory`` / ``tokenization`` → ``loader``; ``tiny`` writes test checkpoints. See
docs/models.md.
"""
