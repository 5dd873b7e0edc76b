"""tools/stress_server.py's own reading of responses (no server): what it counts as the
engine requests of a 200, which the real-server test compares with the server's metrics."""

import json

import httpx

from tools.stress_server import _num_choices


def _sse(*chunks) -> httpx.Response:
    body = "".join(f"data: {json.dumps(c, ensure_ascii=False)}\n\n" for c in chunks)
    return httpx.Response(200, headers={"content-type": "text/event-stream"},
                          content=(body + "data: [DONE]\n\n").encode())


def test_a_streams_choices_are_its_distinct_indices_whatever_its_text_holds():
    """The server writes JSON with ensure_ascii=False: U+2028 and U+0085 arrive unescaped
    inside a chunk's text, and are no SSE line ends."""
    r = _sse({"choices": [{"index": 0, "text": "a\u2028b"}]},
             {"choices": [{"index": 1, "text": "c\u0085d"}]},
             {"choices": [{"index": 0, "text": "e"}]}, {"choices": [], "usage": {}})
    assert _num_choices(r) == 2


def test_json_bodies_count_choices_or_embedding_vectors():
    assert _num_choices(httpx.Response(200, json={"choices": [{}, {}, {}]})) == 3
    assert _num_choices(httpx.Response(200, json={"object": "list", "data": [{}, {}]})) == 2
    assert _num_choices(httpx.Response(200, json={"count": 3, "tokens": [1, 2, 3]})) == 0
