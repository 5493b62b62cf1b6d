"""Scripted stand-ins for the engine fleet and the weight bridge, for loop tests without engines."""
from __future__ import annotations

import http.server
import threading


class ScriptedFleet:
    def __init__(self):
        self.calls = []

    def pause_generation(self, mode="retract"):
        self.calls.append(("pause", mode))

    def continue_generation(self):
        self.calls.append(("continue",))


class ScriptedBridge:
    def __init__(self, engine):
        self.engine, self.versions = engine, []

    def sync(self, version):
        self.engine.version = version
        self.versions.append(version)


class StandInFleet:
    """`count` engines behind one loopback HTTP server, as `<server>/e<i>`: each answers SGLang's
    `GET /health_generate` with 200 at once, except the `hung` ones, which answer only after `hang_s`. Exposes the
    fleet surface the watch reads (`name`, `engine_urls`, `api_key`, `exited`, `dead_engines`, and a router that
    never fails: `router_exit`, `router_answers`)."""

    name, api_key = "", None

    def __init__(self, count: int, hung: set[int], hang_s: float):
        stop = self.stop_event = threading.Event()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                index = int(self.path.split("/")[1][1:])
                if index in hung:
                    stop.wait(hang_s)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        class Server(http.server.ThreadingHTTPServer):
            daemon_threads = True
            request_queue_size = 256  # the listen backlog: every probe of a sweep connects at once

        self.server = Server(("127.0.0.1", 0), Handler)
        base = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.engine_urls = [f"{base}/e{i}" for i in range(count)]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def exited(self):
        return []

    def dead_engines(self):
        return []

    def router_exit(self):
        return None

    def router_answers(self, timeout_s):
        return True

    def close(self) -> None:
        self.stop_event.set()
        self.server.shutdown()
        self.server.server_close()
