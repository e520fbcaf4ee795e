"""A run: the in-process cluster and what drives it.

``runner`` plays a workload against a cluster and returns its report's data; ``mode`` is the one place that
chooses virtual or live (clock, loop); ``wiring`` how routers and workers connect (memory or ZeroMQ);
``factories`` builds routers and engines from a scenario; ``pools`` composes a cluster's pools; ``cluster`` is
the in-process cluster; ``autoscaler`` resizes it; ``replica_stats`` and ``routing_truth`` read it;
``interrupts`` and ``progress`` are a run's signals and progress line.
"""
