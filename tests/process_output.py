"""Reading the output of several kvemu processes that share one stderr."""

import json


def json_events(text: str, name: str) -> list[dict]:
    """The ``{"event": name, ...}`` objects in the output of several processes (lines may interleave)."""
    decoder, key, out = json.JSONDecoder(), '{"event": "' + name + '"', []
    at = text.find(key)
    while at >= 0:
        obj, end = decoder.raw_decode(text, at)
        out.append(obj)
        at = text.find(key, end)
    return out



TAG_ENV = "KVEMU_TEST_TAG"
"""Set to a fresh value in a test's child processes (and so in theirs): ``tagged`` finds them, and only them,
whatever other kvemu processes run on the machine."""


def tagged_env(env: dict[str, str] | None = None) -> tuple[str, dict[str, str]]:
    """A fresh tag and ``env`` (default: this process's environment) carrying it."""
    import os
    import uuid

    tag = uuid.uuid4().hex
    return tag, {**(os.environ if env is None else env), TAG_ENV: tag}


def tagged(tag: str) -> dict[int, str]:
    """The live processes carrying ``tag`` in their environment: pid -> command line (zombies have none)."""
    from pathlib import Path

    mark = f"{TAG_ENV}={tag}".encode()
    out = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if mark in (proc / "environ").read_bytes().split(b"\0"):
                out[int(proc.name)] = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
    return out
