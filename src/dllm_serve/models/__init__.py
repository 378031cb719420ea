"""The model layer: per-family rules, one decoder transformer, the KV pool, checkpoint loading.

Read in import order: ``rope`` → ``kv_pool`` → ``flat_batch`` → ``transformer`` → ``families``
→ ``hub`` / ``memory`` / ``tokenization`` → ``loader``; ``tiny`` writes test checkpoints. See
docs/models.md.
"""
