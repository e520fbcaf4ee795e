"""Reading the output of several kvemu processes that share one stderr."""

import json


def json_events(text: str, name: str) -> list[dict]:
    """The ``{"event": name, ...}`` objects in the output of several processes (lines may interleave)."""
    decoder, key, out = json.JSONDecoder(), '{"event": "%s"' % name, []
    at = text.find(key)
    while at >= 0:
        obj, end = decoder.raw_decode(text, at)
        out.append(obj)
        at = text.find(key, end)
    return out

