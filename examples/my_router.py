"""A router of your own, at its simplest: round robin over the workers, each streamed response passed through.
Start from it for ``kvemu bench-router --router 'cmd:python examples/my_router.py {port} {workers}'``
(docs/routers.md). Usage: ``python my_router.py PORT WORKER_URL...``."""

from __future__ import annotations

import itertools
import sys

import httpx
import uvicorn


def app_for(workers: list[str]):
    client = httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=5.0))
    turn = itertools.cycle(workers)

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        headers = {k.decode(): v.decode() for k, v in scope["headers"] if k.lower() not in (b"host", b"content-length")}
        req = client.build_request(scope["method"], next(turn) + scope["path"], content=body, headers=headers)
        resp = await client.send(req, stream=True)
        await send({"type": "http.response.start", "status": resp.status_code,
                    "headers": [(b"content-type", resp.headers.get("content-type", "text/plain").encode())]})
        async for chunk in resp.aiter_raw():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await resp.aclose()
        await send({"type": "http.response.body", "body": b""})

    return app


if __name__ == "__main__":
    uvicorn.run(app_for(sys.argv[2:]), host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
