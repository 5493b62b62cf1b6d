"""The client's version check on answers without per-token spans (SGLang servers that report one
`meta_info.weight_version` per request), over real HTTP against a stand-in that speaks SGLang's /generate answer:
an answer held behind an abort pause ran wholly on the weights after it and is kept (issue 26 item 5); one that a
retract pause may have split is still refused."""
from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from glue.fleet.engine_client import EngineClient


@contextlib.contextmanager
def held_answer_server(release: threading.Event):
    """/generate answers only once `release` is set (the request waited behind a pause), with SGLang's one-version
    meta_info; every control route answers 200."""

    class Engine(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            body: dict = {"success": True}
            if self.path == "/generate":
                release.wait(30)
                body = {"output_ids": [7, 8], "meta_info": {"weight_version": "2", "finish_reason": {"type": "stop"},
                                                            "output_token_logprobs": [[-0.1, 7, None],
                                                                                      [-0.2, 8, None]]}}
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Engine)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def answer_after_a_pause(mode: str) -> dict:
    release = threading.Event()
    with held_answer_server(release) as url:
        async def scenario():
            client = EngineClient(url, [url])
            try:
                request = asyncio.ensure_future(client.generate([1, 2], {"max_new_tokens": 2}))
                await asyncio.sleep(0.3)  # sent before the pause; the engine holds it
                await asyncio.to_thread(client.pause_generation, mode)
                await asyncio.to_thread(client.continue_generation)  # a sync in between: new weights, version 2
                release.set()
                return await asyncio.wait_for(request, 30)
            finally:
                await client.close()

        return asyncio.run(scenario())


def test_an_answer_held_behind_an_abort_pause_is_kept_with_the_version_it_ran_on():
    answer = answer_after_a_pause("abort")
    assert answer["output_ids"] == [7, 8] and answer["meta_info"]["weight_version"] == "2"


def test_an_answer_a_retract_pause_may_have_split_without_spans_is_still_refused():
    with pytest.raises(ValueError, match="no per-token meta_info.weight_versions"):
        answer_after_a_pause("retract")
