"""Tensor parallelism: the group rank 0 drives (``group.py``: control channel, failure, heart
beats), how the ranks find each other (``rendezvous.py``) and the vocab-parallel sampler's
collectives (``vocab.py``). The worker processes themselves are ``engine/workers.py``."""
