"""The repairs a FleetWatch runs on an engine that died or hangs: `engine_repair` for the policy's fleet (the new
engine brought to the fleet's weights before the router sees it), `fleet_repair` for a fleet whose weights never
change (a teacher's, a judge's)."""
from __future__ import annotations

import threading
from typing import Any, Callable


def engine_repair(fleet: Any, bridge: Any, *, trainer_turn: threading.Lock | None = None, client: Any = None,
                  pause_mode: str | None = None) -> Callable[[int], None]:
    """The usual `repair`: the bridge stops syncing the faulty engine, the fleet replaces it and the bridge brings
    the new one to the fleet's weights before the router sees it. If the new engine cannot be routed to after all,
    the bridge forgets it again (it is stopped). The weights are gathered by the trainer's collectives, so the
    catch-up waits for `trainer_turn` (the lock `FleetWatch.guarded_train` holds around every train step and
    checkpoint); a trainer that trained since the last sync brings the whole fleet to its version
    (`WeightBridge.add_engine`), with generation paused through `client` (in `pause_mode`) meanwhile."""
    turn = trainer_turn or threading.Lock()

    def prepare(url: str) -> None:
        with turn:
            if client is None or not bridge.is_behind_source():
                bridge.add_engine(url)
                return
            client.pause_generation(pause_mode or "retract")
            bridge.add_engine(url)  # a failure leaves generation paused: weights may be half written
            client.continue_generation()

    def repair(index: int) -> None:
        # with the engines that died beside it (a lost node's): a channel rebuilt to them would fail
        bridge.remove_engine(fleet.engine_urls[index], *(fleet.engine_urls[i] for i in fleet.dead_engines()))
        try:
            fleet.replace_engine(index, prepare=prepare)
        except BaseException:
            bridge.remove_engine(fleet.engine_urls[index])
            raise

    return repair


def fleet_repair(fleet: Any) -> Callable[[int], None]:
    """The repair of a fleet whose weights never change (a teacher's, a judge's): the faulty engine is replaced on
    its bundle and routed to once it serves."""

    def repair(index: int) -> None:
        fleet.replace_engine(index)

    return repair
