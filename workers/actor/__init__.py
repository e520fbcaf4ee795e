"""The async shell around a worker's engine cores: the actor (``actor.py``: ``WorkerActor``) that serves a router
link, the one seam for the run mode (``drivers.py``: ``ModeDriver``) and the worker's Prometheus metrics
(``metrics.py``: ``VllmMetrics``).

It sees each rank's engine only as a ``workers.rank_engine.RankEngine`` (what it needs of a core, whatever the
flavour); the engines never import it.
"""
