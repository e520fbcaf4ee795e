"""A fake prefill worker over ZeroMQ (no ``KVEMU_SECRET``, so any peer may register) cannot take the real decode
workers down (issue #43): its ``Finished(kv_transfer=...)`` with a link model no decode rank can price does not
decode at the router, is never forwarded, and the decode worker process serves every later request.

Before, the router forwarded it, the decode worker's pass raised ``OverflowError`` (``round(inf)``), its process
exited 1, and every later request failed ``no_endpoints``."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import pytest
import zmq

from harness.procs.loadgen import _RouterClient
from harness.procs.up import Children
from kvemu.messages import (ClientRequest, Dispatch, DispatchAck, Finished, Heartbeat, Register, decode_router_message,
                            encode)
from kvemu.runtime.loop import run_live
from kvemu.runtime.transport import message_socket
from kvemu.transfer import KvTransfer

ENGINE = "{block_size: 32, num_gpu_blocks: 2048, speedup_ratio: 20, decode_speedup_ratio: 20}"
SCENARIO = f"""
name: fake-prefill-peer
cluster:
  prefill: {{workers: 2, engine: {ENGINE}}}
  decode: {{workers: 1, engine: {ENGINE}}}
router: {{policy: kv, heartbeat_timeout_s: 30}}
workload: {{kind: synthetic, rate_rps: 1}}
run: {{mode: live, seed: 4, duration_s: 2}}
"""
HOSTILE = KvTransfer(source_worker_id=0, bandwidth_gbps=1e-300, bytes_per_token=2**40)
"""Built in code, so not validated: encoded as it is, as a hostile peer would send it."""


@pytest.mark.process_supervision
def test_a_fake_prefill_peer_cannot_stop_the_real_decode_worker(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(SCENARIO)
    kids = Children()
    try:
        router = kids.start("router", ["router", "--listen", "tcp://127.0.0.1:0", "--config", str(path)])["listen"]
        kids.start("p", ["worker", "--router", router, "--worker-id", "1", "--worker-type", "prefill",
                         "--config", str(path)])
        kids.start("d", ["worker", "--router", router, "--worker-id", "2", "--worker-type", "decode",
                         "--config", str(path)])
        out: dict[str, object] = {}

        async def main() -> None:
            fake = message_socket(zmq.DEALER)
            fake.connect(router)
            await fake.send_multipart([encode(Register(worker_id=0, worker_type="prefill", block_size=32))])

            async def serve() -> None:  # it accepts every prefill leg and finishes it with the hostile link
                while True:
                    for frame in await fake.recv_multipart():
                        msg = decode_router_message(frame)
                        if type(msg) is Dispatch:
                            rid = msg.request_id
                            await fake.send_multipart([encode(DispatchAck(request_id=rid, accepted=True)), encode(
                                Finished(request_id=rid, times_ns=[time.monotonic_ns()], kv_transfer=HOSTILE))])

            async def beat() -> None:
                while True:
                    await fake.send_multipart([encode(Heartbeat(worker_id=0))])
                    await anyio.sleep(0.5)

            client = _RouterClient(router)
            async with anyio.create_task_group() as tg:
                tg.start_soon(serve)
                tg.start_soon(beat)
                tg.start_soon(client.listen)
                with anyio.fail_after(60):
                    while len((await client.stats(timeout_s=5)).workers) < 3:
                        await anyio.sleep(0.05)
                    with anyio.move_on_after(3):  # its Finished is dropped at the router: no answer
                        out["evil"] = await client.submit(ClientRequest(
                            request_id="evil", tokens=list(range(100)), max_tokens=4, prefill_worker_id=0))
                    await client.cancel("evil", "test_cancel")
                    await anyio.sleep(0.5)  # what the decode worker would have got, it would have got by now
                    out["later"] = [await client.submit(ClientRequest(
                        request_id=f"r{i}", tokens=list(range(1000 * i, 1000 * i + 100)), max_tokens=4,
                        prefill_worker_id=1)) for i in range(5)]
                tg.cancel_scope.cancel()
            client.sock.close(linger=0)
            fake.close(linger=0)

        run_live(main)
        assert "evil" not in out  # never answered as if it had run
        assert kids.procs["d"].poll() is None  # the decode worker lives
        later = out["later"]
        assert isinstance(later, list) and [r.failure for r in later] == [None] * 5
        assert all(r.worker_id == 2 and r.output_tokens == 4 for r in later)
    finally:
        kids.stop_all()
