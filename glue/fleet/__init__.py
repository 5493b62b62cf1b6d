"""The fleet: inference engines behind sgl-router, started, watched and talked to.

Owns starting engines and the router (`fleet.py`), the processes sluice owns by pid (`processes.py`), engines on other
nodes through a Ray actor (`engine_host.py`), an engine that spans nodes as one (`spanning.py`), health checks and
repair (`watch.py`), liveness while a control call waits on the engines (`liveness.py`), and the HTTP client for
generation and control (`engine_client.py`).
May import: types, plugins; weight_sync (the engine endpoints it speaks). Never loop, rollout, rewards or trainer.
"""
