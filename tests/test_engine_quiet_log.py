"""The router's HTTP/2 probe (`PRI * HTTP/2.0` preface) no longer leaves a traceback in the engine log, and the
engine goes on serving."""
import socket
from urllib.parse import urlparse

from helpers.engines import call

HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x12\x04\x00\x00\x00\x00\x00"


def test_an_http2_probe_gets_no_traceback_in_the_log_and_the_engine_serves_on(engine_processes, tiny_model_dir):
    url = engine_processes.start(tiny_model_dir, "--num-threads", "1")
    host, port = urlparse(url).hostname, urlparse(url).port
    for _ in range(3):
        with socket.create_connection((host, port), timeout=10) as probe:
            probe.sendall(HTTP2_PREFACE)
            assert b" 400 " in probe.recv(1024).split(b"\r\n")[0]  # aiohttp refuses it, as before
    # ignore_eos: the tiny random model may sample its end token first (seen once: 1 token of 2)
    status, answer = call(url, "/generate", {"input_ids": [0, 4],
                                             "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}})
    assert status == 200 and len(answer["output_ids"]) == 2
    log = engine_processes.log_of(url)
    assert "Traceback" not in log and "BadHttpMessage" not in log, log[-2000:]
