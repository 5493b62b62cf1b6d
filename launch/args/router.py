"""sgl-router options for `--router-*`: taken from the installed `sglang_router` package's own argparse definition
(`RouterArgs.add_cli_args`) and forwarded to the router's command line. Options sluice sets itself are refused."""
from __future__ import annotations

import argparse
import functools

from launch.args.options import OptionSpec, specs_from_parser

OWNED = {
    "host": "the placement plan (the router listens on the driver's address)",
    "port": "the placement plan (sluice picks a free port)",
    "worker_urls": "rollout.num_engines (sluice registers every engine it starts)",
    "policy": "rollout.router_policy",
}


@functools.cache
def router_options() -> dict[str, OptionSpec] | None:
    """Every sgl-router option by config key, or None when sglang_router is not installed."""
    try:
        from sglang_router.router_args import RouterArgs
    except ImportError:
        return None
    scratch = argparse.ArgumentParser(add_help=False)
    RouterArgs.add_cli_args(scratch, use_router_prefix=False)
    return specs_from_parser(scratch)
