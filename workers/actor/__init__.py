"""The async shell around a worker's engine cores: the actor (``actor.py``: ``WorkerActor``) that serves a router
link, the one seam for the run mode (``drivers.py``: ``ModeDriver``) and the worker's Prometheus metrics
(``metrics.py``: ``VllmMetrics``).

The engines never import it.
"""
