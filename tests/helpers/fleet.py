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


class LoopbackFleet:
    """Engines served by one loopback HTTP server (`server`, set up by the subclass), with the rest of the fleet
    surface the watch reads: nothing exits and the router never fails. `close` lets every answer held on
    `stop_event` go and stops the server."""

    name, api_key = "", None

    def close(self) -> None:
        self.stop_event.set()
        self.server.shutdown()
        self.server.server_close()

    def exited(self):
        return []

    def dead_engines(self):
        return []

    def router_exit(self):
        return None

    def router_answers(self, timeout_s):
        return True


class StandInFleet(LoopbackFleet):
    """`count` engines behind one loopback HTTP server, as `<server>/e<i>`: each answers SGLang's
    `GET /health_generate` with 200 at once, except the `hung` ones, which answer only after `hang_s`."""

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


class SlowEngineFleet(LoopbackFleet):
    """One engine on a loopback HTTP server, speaking the routes of an SGLang server (http_server.py):
    `POST /pause_generation` is answered after `pause_s` (a long batch finishing first); `GET /model_info` at once,
    counted in `info_probes`; `GET /health` and `/health_generate` while paused only after
    SGLANG_HEALTH_CHECK_TIMEOUT (20 s) with 503, as SGLang's health check generates a token. Started `silent` it
    answers nothing at all (a SIGSTOPped server: connections are taken, never answered) until `wake()`."""

    def __init__(self, pause_s: float = 0.0, silent: bool = False, health_while_paused_s: float = 20.0):
        fleet, stop = self, threading.Event()
        self.stop_event, self.awake, self.paused, self.info_probes = stop, threading.Event(), False, 0
        if not silent:
            self.awake.set()

        class Handler(http.server.BaseHTTPRequestHandler):
            def answer(self, status: int) -> None:
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_GET(self):
                fleet.awake.wait()
                if self.path == "/model_info":
                    fleet.info_probes += 1
                    return self.answer(200)
                if fleet.paused:
                    stop.wait(health_while_paused_s)
                    return self.answer(503)
                self.answer(200)

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                fleet.awake.wait()
                fleet.paused = self.path == "/pause_generation"
                if fleet.paused:
                    stop.wait(pause_s)
                self.answer(200)

            def log_message(self, *args):
                pass

        class Server(http.server.ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address):
                pass  # an answer held while silent goes to a client that gave up on it

        self.server = Server(("127.0.0.1", 0), Handler)
        self.engine_urls = [f"http://127.0.0.1:{self.server.server_address[1]}"]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wake(self) -> None:
        self.awake.set()

    def close(self) -> None:
        self.awake.set()
        super().close()
