"""The README's separate-process recipe, as a user types it: a ``kvemu worker`` started without the router's
scenario ran the default engine (mean E2E 412.7 ms where ``examples/compose.yaml`` says 37.4 ms) and nobody said
so. Now the router refuses it, naming the knobs that differ; with ``--config`` it registers."""

from __future__ import annotations

import subprocess
from pathlib import Path

from harness.procs.up import Children, cli_command, cli_env
from tests.end_to_end.test_live_disagg import _stats_once

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = str(ROOT / "examples" / "compose.yaml")
WORKER = ["worker", "--dp-size", "2", "--kv-events", "tcp://127.0.0.1:0", "--kv-replay", "tcp://127.0.0.1:0"]


def test_a_worker_without_the_routers_scenario_is_refused_naming_the_knobs_and_with_it_registers():
    kids = Children()
    try:
        router = kids.start("router", ["router", "--listen", "tcp://127.0.0.1:0", "--config", COMPOSE])["listen"]
        bare = subprocess.run(cli_command(*WORKER, "--router", router, "--worker-id", "5"), env=cli_env(),
                              capture_output=True, text=True, timeout=30)
        assert bare.returncode == 1, bare.stderr
        assert ("kvemu worker: worker 5: registration refused: engine_mismatch: worker 5 runs speedup_ratio=1.0, "
                "decode_speedup_ratio=1.0 where the router's scenario says speedup_ratio=4.0, decode_speedup_ratio=4.0;"
                " start it with the router's scenario (kvemu worker --config FILE") in bare.stderr, bare.stderr
        kids.start("w6", [*WORKER, "--router", router, "--worker-id", "6", "--config", COMPOSE])
        assert _stats_once(router, workers=1).workers == [6]  # the refused worker 5 left no trace
    finally:
        kids.stop_all()
