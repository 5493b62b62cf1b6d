"""`python -m glue.embedded_engine --model-path DIR --port P`: start one embedded engine process (CPU stand-in for
an SGLang server) serving SGLang's HTTP API until SIGTERM / SIGINT."""
from __future__ import annotations

import argparse
import random
import sys

from glue.embedded_engine.node_ranks import follow, gather_node_ranks, stop_when_a_rank_leaves


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m glue.embedded_engine", description=__doc__)
    parser.add_argument("--model-path", required=True, help="directory of an HF causal LM (config.json + safetensors)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=30000, help="port to listen on")
    parser.add_argument("--random-seed", "--seed", dest="seed", type=int, default=None,
                        help="SGLang's flag: seed of the generator that draws each request's sampling seed (default: "
                             "a random one, as SGLang; engines of one fleet must not share it, glue.fleet.fleet.engine_seed)")
    parser.add_argument("--max-running-requests", type=int, default=64, help="rows decoded together at most")
    parser.add_argument("--num-threads", type=int, default=1, help="torch intra-op threads for the model")
    parser.add_argument("--weight-version", default=None,
                        help="initial weight version string (default: SGLang's 'default' with --sglang-strict, else '0')")
    parser.add_argument("--weight-sync-timeout-s", type=float, default=300.0, help="timeout of weight-group collectives")
    parser.add_argument("--api-key", default=None,
                        help="SGLang's --api-key: every route but /health* needs `Authorization: Bearer <key>`")
    parser.add_argument("--admin-api-key", default=None,
                        help="SGLang's --admin-api-key: admin routes (weights, memory, pause/continue, abort, flush) "
                             "need this key, and no longer accept --api-key")
    parser.add_argument("--enable-deterministic-inference", action="store_true",
                        help="SGLang's flag: a token depends only on weights, context and sampling_seed (each token "
                             "from an uncached forward of its own request, sampled with a (seed, position) generator)")
    parser.add_argument("--enable-return-routed-experts", action="store_true",
                        help="SGLang's flag: record the MoE routing of every token so /generate answers "
                             "return_routed_experts (MoE models only; routing replay, R3)")
    parser.add_argument("--sglang-strict", action="store_true",
                        help="answer exactly as SGLang 0.5.23 does (request structs, reply shapes, weight-update "
                             "sessions, flush/pause/health/memory semantics); no sluice extras (checksums, test hooks)")
    parser.add_argument("--tp-size", type=int, default=1,
                        help="SGLang's flag; N > 1 (only with --sglang-strict) simulates N TP ranks on the weight "
                             "path: N members join the weight group, /update_weights_from_tensor takes one payload "
                             "per rank")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "float", "bfloat16", "half", "float16"],
                        help="SGLang's flag: the weights' dtype; auto = the checkpoint's torch_dtype (bf16 for a bf16 "
                             "checkpoint, else float32)")
    parser.add_argument("--device", default="cpu",
                        help="SGLang's flag: where the model and KV cache live (cpu, or cuda on a GPU machine)")
    parser.add_argument("--enable-memory-saver", action="store_true",
                        help="SGLang's flag: without it /release_memory_occupation and /resume_memory_occupation "
                             "release nothing (under --sglang-strict; the lenient engine always releases)")
    _add_node_args(parser)
    args = parser.parse_args(argv)
    if args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        parser.error(f"--node-rank {args.node_rank} must be in [0, --nnodes {args.nnodes})")
    if args.nnodes > 1 and (not args.sglang_strict or args.dist_init_addr is None or args.tp_size % args.nnodes):
        parser.error("--nnodes > 1 needs --sglang-strict, --dist-init-addr and a --tp-size that is a multiple of it")
    if args.max_running_requests < 1 or args.num_threads < 1:
        parser.error("--max-running-requests and --num-threads must be >= 1")
    if args.tp_size < 1 or (args.tp_size > 1 and not args.sglang_strict):
        parser.error("--tp-size must be >= 1, and > 1 only with --sglang-strict")
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1 << 30)
    if args.weight_version is None:
        args.weight_version = "default" if args.sglang_strict else "0"
    return args


def _add_node_args(parser: argparse.ArgumentParser) -> None:
    """SGLang's flags of an engine that spans nodes (glue.embedded_engine.node_ranks stands in for it)."""
    parser.add_argument("--nnodes", type=int, default=1, help="SGLang's flag: nodes the engine spans, a server each")
    parser.add_argument("--node-rank", type=int, default=0,
                        help="SGLang's flag: this server's node; 0 serves HTTP, the others join it and serve nothing")
    parser.add_argument("--dist-init-addr", default=None,
                        help="SGLang's flag: host:port of node rank 0, where the other node ranks join it")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.node_rank > 0:  # SGLang's follower node: no model, no HTTP
        return follow(args.dist_init_addr, args.node_rank)
    if args.nnodes > 1:  # serve once every node rank has joined, stop when one leaves
        stop_when_a_rank_leaves(gather_node_ranks(args.dist_init_addr, args.nnodes))
    from glue.embedded_engine.engine import build_engine, serve  # lazy: torch, aiohttp; launch.plan.run_plan imports this module

    try:
        server = build_engine(model_path=args.model_path, host=args.host, port=args.port, seed=args.seed,
                              max_running_requests=args.max_running_requests, num_threads=args.num_threads,
                              weight_version=args.weight_version, weight_sync_timeout_s=args.weight_sync_timeout_s,
                              api_key=args.api_key, admin_api_key=args.admin_api_key,
                              deterministic=args.enable_deterministic_inference,
                              enable_return_routed_experts=args.enable_return_routed_experts,
                              sglang_strict=args.sglang_strict, tp_size=args.tp_size,
                              enable_memory_saver=args.enable_memory_saver, dtype=args.dtype,
                              device=args.device, nnodes=args.nnodes, dist_init_addr=args.dist_init_addr)
    except (FileNotFoundError, ValueError) as e:
        print(f"embedded engine: {e}", file=sys.stderr, flush=True)
        return 2
    serve(server, host=args.host, port=args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
