"""What a ``cmd:`` router in ``kvemu bench-router`` must do, in one place: the placeholders its command may
use, how soon it must answer, and the text ``--help`` and the README show (light: the parser imports it)."""

from __future__ import annotations

__all__ = ["CMD_CONTRACT", "PLACEHOLDERS", "READY_TIMEOUT_S"]

READY_TIMEOUT_S = 60.0
"""How long a router may take to answer ``/health`` and ``/v1/models`` before its run is given up."""
PLACEHOLDERS = {
    "flags": "vllm-router's arguments for the fleet: --worker-urls, DP size, KV-event sources",
    "sglang_flags": "sglang-router's arguments for the fleet",
    "workers": "the workers' URLs, space-separated",
    "port": "the port to listen on",
}
"""What a ``cmd:`` router's command may say, and what each is filled with."""
CMD_CONTRACT = (
    "A cmd: router's command is run with its placeholders filled in: "
    + "; ".join(f"{{{k}}} = {v}" for k, v in PLACEHOLDERS.items())
    + " (write {{ and }} for a literal brace). It must listen on 127.0.0.1:{port}, answer GET /health "
    f"with 200 within {READY_TIMEOUT_S:g} s (else its row records why and the next router runs), and pass "
    "streamed POST /v1/completions on to the workers; it is stopped with SIGTERM at the end. Its row and folder "
    "are named after its program, or an interpreter's script or -m module (cmd:my_proxy.py), -2, -3... for "
    "repeats.")
"""The ``cmd:`` contract, as ``kvemu bench-router --help`` and the README state it."""
