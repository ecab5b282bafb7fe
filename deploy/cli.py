"""`pdserve` command line: serve | generate | demo | plan | profile | bench | simulate | model init."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import socket
import sys

from deploy.config import ConfigError, load_config, parse_override

SERVE_FLAGS = {  # flag dest -> config key
    "model": "model.name", "host": "server.host", "port": "server.port",
    "prefill_actors": "pools.prefill.count", "decode_actors": "pools.decode.count",
    "transport": "kv_transfer.transport", "kv_compression": "kv_transfer.compression",
    "address": "ray.address", "metrics_port": "server.metrics_port", "log_format": "server.log_format",
    "http_port": "server.http_port",
    "dtype": "model.dtype", "kv_cache_dtype": "kv_cache.dtype", "speculative_method": "speculative.method",
    "prefill_tp": "pools.prefill.tensor_parallel", "decode_tp": "pools.decode.tensor_parallel",
}


def _config_help(key: str, text: str | None = None) -> str:
    """A config flag's help: what it sets (the section field's description unless ``text``), the key, and the
    embedded default's value."""
    section, field = key.rsplit(".", 1)
    node = load_config(None)
    for part in section.split("."):
        node = getattr(node, part)
    description = text or type(node).model_fields[field].description or ""
    default = getattr(node, field)
    return f"{description.rstrip('.')} (config {key}; default {'none' if default is None else default})"


def add_config_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="pools.yaml (default: the embedded default)")
    p.add_argument("--model", help=_config_help("model.name", "embedded model (pydoc: trained; tiny, small: "
                                                "random weights) or a model directory"))
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], help=_config_help("model.dtype"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config key, e.g. --set kv_cache.num_blocks=2048")


def config_from_args(args: argparse.Namespace):
    if args.config is not None and not args.config.strip():     # e.g. --config "$UNSET"
        raise ConfigError("--config: empty path (leave --config out for the embedded default)")
    overrides = {key: getattr(args, dest, None) for dest, key in SERVE_FLAGS.items()}
    for item in args.set:
        key, value = parse_override(item)
        overrides[key] = value
    cfg = load_config(args.config, overrides)
    if not cfg.ray.address:
        # A local Ray instance: keep every Ray listener on 127.0.0.1. Ray reads this when it is
        # imported, so it is set here, before any command imports ray.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    return cfg


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("pdserve")
    except PackageNotFoundError:
        return "unknown (not installed)"


def busy_port(cfg) -> str | None:
    """The first port the router will bind that is taken, as one line naming it and its flag; else None.

    Checked before Ray starts, so a conflict costs a second, not a cluster start-up.
    """
    server = cfg.server
    ports = ((server.port, "--port", "server.port"), (server.http_port, "--http-port", "server.http_port"),
             (server.metrics_port, "--metrics-port", "server.metrics_port"))
    for port, flag, key in ports:
        if not port:
            continue
        with socket.socket(socket.AF_INET6 if ":" in server.host else socket.AF_INET) as sock:
            try:
                sock.bind((server.host, port))
            except OSError as e:
                return (f"port {port} on {server.host} is not free ({e.strerror}); choose another with {flag} "
                        f"(config {key})")
    return None


def cmd_serve(args: argparse.Namespace) -> int:
    cfg = args.cfg
    problem = busy_port(cfg)
    if problem:
        print(f"pdserve serve: {problem}", file=sys.stderr)
        return 2
    from deploy.running import start_cluster
    from router.log import configure_logging
    from router.server import serve_until_signal
    configure_logging(cfg.server.log_format)

    async def main() -> None:
        cluster = await start_cluster(cfg)
        await cluster.server.wait_ready(120)
        drained = await serve_until_signal(cluster.server)
        await cluster.stop()
        logging.getLogger("pdserve").info("shut down (drained=%s)", drained)
    asyncio.run(main())
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    import grpc

    from router.client import generate
    sampling = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                    top_k=args.top_k, seed=args.seed, stop=args.stop or None, ignore_eos=args.ignore_eos or None)
    try:
        last = None
        for msg in generate(args.address, args.prompt, token=args.token, timeout=args.timeout, **sampling):
            last = msg
            if args.json:
                from google.protobuf.json_format import MessageToDict
                print(json.dumps(MessageToDict(msg)), flush=True)
            else:
                print(msg.text, end="", flush=True)
        if not args.json and last is not None:
            t = last.timing
            print(f"\n[{last.usage.completion_tokens} tokens, ttft {t.ttft_s * 1e3:.0f} ms, "
                  f"e2e {t.e2e_s * 1e3:.0f} ms]", file=sys.stderr)
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from deploy.demo import run_demo
    return run_demo(args.cfg, verbose=args.verbose)


def cmd_model_init(args: argparse.Namespace) -> int:
    from engine.model.presets import init_preset
    path = init_preset(args.name, args.dir)
    print(f"wrote preset {args.name!r} to {path}")
    return 0


BENCHES = {"engine": "bench.engine", "transfer": "bench.transfer", "serve": "bench.serving",
           "kv_quality": "bench.kv_quality", "stream_latency": "bench.serving.stream_latency", "chaos": "bench.chaos",
           "spec": "bench.spec"}


def cmd_bench(args: argparse.Namespace) -> int:
    import importlib
    module = importlib.import_module(BENCHES[args.what])
    return module.main(args.rest)


def _search_flags_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with `pdserve plan`'s --devices, --tp, --allreduce-us and --allreduce-gbps, as one line; else
    None."""
    if args.devices < 1:
        return f"--devices {args.devices}: the number of devices to plan for, at least 1"
    try:
        degrees = [int(d) for d in args.tp.split(",")]
    except ValueError:
        degrees = []
    if not degrees or min(degrees) < 1:
        return f"--tp {args.tp}: a comma-separated list of positive degrees, e.g. 1,2,4"
    if not (math.isfinite(args.allreduce_us) and args.allreduce_us >= 0):
        return f"--allreduce-us {args.allreduce_us:g}: a finite latency in µs, at least 0"
    if not (math.isfinite(args.allreduce_gbps) and args.allreduce_gbps > 0):
        return f"--allreduce-gbps {args.allreduce_gbps:g}: a finite bandwidth in GB/s, above 0"
    return None


def cmd_plan(args: argparse.Namespace) -> int:
    from deploy.plan_cli import run_plan
    from deploy.plan_cli import ParallelismSearch
    search = None
    if args.devices is None:
        given = [flag for flag, value in (("--tp", args.tp), ("--allreduce-us", args.allreduce_us),
                                          ("--allreduce-gbps", args.allreduce_gbps)) if value is not None]
        if given:
            print(f"error: {given[0]}: tunes the parallelism search, which needs --devices N", file=sys.stderr)
            return 2
    else:
        defaults = ParallelismSearch(args.devices)
        args.tp = ",".join(map(str, defaults.degrees)) if args.tp is None else args.tp
        args.allreduce_us = defaults.allreduce_us if args.allreduce_us is None else args.allreduce_us
        args.allreduce_gbps = defaults.allreduce_gbps if args.allreduce_gbps is None else args.allreduce_gbps
        problem = _search_flags_problem(args)
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
        search = ParallelismSearch(args.devices, tuple(int(d) for d in args.tp.split(",")), args.allreduce_us,
                                   args.allreduce_gbps)
    return run_plan(args.cfg, as_json=args.json, profile_path=args.profile, local=args.local, search=search,
                    spec_acceptance=args.spec_acceptance)


def cmd_profile(args: argparse.Namespace) -> int:
    from deploy.plan_cli import run_profile
    try:
        degrees = tuple(int(d) for d in args.tp.split(",") if d)
    except ValueError:
        print(f"error: --tp {args.tp}: a comma-separated list of degrees, e.g. 1,2", file=sys.stderr)
        return 2
    return run_profile(args.cfg, args.out, local=args.local, degrees=degrees)


def _http_port(value: str) -> int | str:
    """``--http-port``: a port number, or "none" (passed on as "none": server.http_port reads it as null)."""
    if value.lower() in ("none", "null", "off"):
        return "none"
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number or 'none', got {value!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving.")
    parser.add_argument("--version", action="version", version=f"pdserve {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="start Ray pools and the gRPC router")
    add_config_flags(p)
    p.add_argument("--host", help=_config_help("server.host"))
    p.add_argument("--port", type=int, help=_config_help("server.port"))
    p.add_argument("--prefill-actors", type=int, help=_config_help("pools.prefill.count", "prefill actors"))
    p.add_argument("--decode-actors", type=int, help=_config_help("pools.decode.count", "decode actors"))
    p.add_argument("--prefill-tp", type=int, help=_config_help("pools.prefill.tensor_parallel",
                                                               "tensor-parallel ranks per prefill actor"))
    p.add_argument("--decode-tp", type=int, help=_config_help("pools.decode.tensor_parallel",
                                                              "tensor-parallel ranks per decode (or colocated) actor"))
    p.add_argument("--transport", choices=["grpc", "tcp", "torch", "ray", "nixl"],
                   help=_config_help("kv_transfer.transport", "how prefill ships KV blocks to decode"))
    p.add_argument("--kv-compression", choices=["fp8", "int8", "none"],
                   help=_config_help("kv_transfer.compression", "KV block encoding on the wire"))
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "int8"],
                   help=_config_help("kv_cache.dtype", "how the KV cache stores K and V"))
    p.add_argument("--speculative-method", choices=["off", "ngram", "draft"],
                   help=_config_help("speculative.method", "speculative decoding on decode and colocated actors"))
    p.add_argument("--address", help=_config_help("ray.address", "Ray address to join (e.g. auto); none: a local "
                                                  "Ray on 127.0.0.1"))
    p.add_argument("--metrics-port", type=int, help=_config_help("server.metrics_port"))
    p.add_argument("--http-port", type=_http_port, metavar="PORT|none",
                   help=_config_help("server.http_port", "OpenAI-compatible HTTP port ('none': no HTTP server)"))
    p.add_argument("--log-format", choices=["text", "json"], help=_config_help("server.log_format"))
    p.set_defaults(fn=cmd_serve)

    p = sub.add_parser("generate", help="stream one completion from a running server",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--address", default="127.0.0.1:50051", help="the router's gRPC address")
    p.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate")
    p.add_argument("--temperature", type=float, help="sampling temperature (0: greedy; unset: the model's default)")
    p.add_argument("--top-p", type=float, help="nucleus sampling mass")
    p.add_argument("--top-k", type=int, help="sample among the k likeliest tokens")
    p.add_argument("--seed", type=int, help="seed for reproducible sampling")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    p.add_argument("--token", help="bearer token of the server")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the whole answer")
    p.add_argument("--json", action="store_true", help="print each response message as JSON")
    p.set_defaults(fn=cmd_generate)

    p = sub.add_parser("demo", help="start the embedded cluster, run a few requests, stop")
    add_config_flags(p)
    p.add_argument("--verbose", action="store_true",
                   help="stream the actors' output and every log line here (default: to a log file it names)")
    p.set_defaults(fn=cmd_demo)

    for name, fn, helptext in (("plan", cmd_plan, "size the pools from a profile"),
                               ("profile", cmd_profile, "measure prefill FLOP/s and decode bytes/s")):
        p = sub.add_parser(name, help=helptext)
        add_config_flags(p)
        p.add_argument("--speculative-method", choices=["off", "ngram", "draft"],
                       help=_config_help("speculative.method", "speculative decoding on the decode actors"))
        if name == "plan":
            p.add_argument("--json", action="store_true")
            p.add_argument("--profile", help="profile file (default: profile this machine first)")
            p.add_argument("--devices", type=int, help="search each pool's tensor-parallel degree and count "
                           "within this many devices (DistServe-style: most goodput per device meeting the SLOs)")
            p.add_argument("--tp", help="degrees to try with --devices (default 1,2,4)")
            p.add_argument("--allreduce-us", type=float,
                           help="with --devices: latency of one all-reduce among a degree's ranks, µs (default 30)")
            p.add_argument("--allreduce-gbps", type=float,
                           help="with --devices: all-reduce bandwidth among a degree's ranks, GB/s (default 100)")
            p.add_argument("--spec-acceptance", type=float, metavar="A",
                           help="with speculative decoding: the acceptance rate to size decode at (accepted / "
                           "proposed tokens, 0..1; default: the profile's measurement, else no speed-up)")
        else:
            p.add_argument("--out", help="where to save the profile (default: the config's cached profile)")
            p.add_argument("--tp", default="1", help="tensor-parallel degrees to measure both pools at (default "
                           "1; e.g. 1,2: the planner uses measured degrees and predicts the others)")
        p.add_argument("--local", action="store_true",
                       help="measure in-process engines with the pools' settings instead of Ray actors")
        p.set_defaults(fn=fn)

    p = sub.add_parser("bench", help="benchmarks: " + " | ".join(BENCHES))
    p.add_argument("what", choices=list(BENCHES))
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(fn=cmd_bench)

    sub.add_parser("simulate", help="the router and schedulers on a simulated clock: should I disaggregate? "
                   "(pdserve simulate --help)")

    p = sub.add_parser("model", help="model presets")
    msub = p.add_subparsers(dest="model_command", required=True)
    m = msub.add_parser("init", help="write a preset as a Hugging Face directory")
    m.add_argument("name", choices=["tiny", "small"])
    m.add_argument("dir")
    m.set_defaults(fn=cmd_model_init)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["simulate"]:        # its own parser takes every flag (argparse's REMAINDER drops leading ones)
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        from bench.simulate.cli import main as simulate
        return simulate(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command not in ("serve",):
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        if hasattr(args, "config"):     # load (and check) the config before any command imports ray
            args.cfg = config_from_args(args)
        return args.fn(args)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
