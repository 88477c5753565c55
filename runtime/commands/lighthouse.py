"""`tessera lighthouse`: torchft's lighthouse for fault-tolerant runs whose replica groups are separate jobs
(torchrun, Slurm): it decides each step's quorum of live groups. The local launcher starts its own."""

from __future__ import annotations

import argparse
import signal
import sys
import threading


def add_lighthouse_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "lighthouse",
        help="torchft's lighthouse for --fault-tolerant replica groups run as separate jobs (needs the ft extra)",
    )
    p.add_argument("--port", type=int, default=29510, help="the port to listen on (default 29510; 0: any free)")
    p.add_argument("--min-replicas", type=int, default=1, help="the fewest replica groups a quorum may hold")
    p.add_argument(
        "--heartbeat-timeout", type=float, default=2.0, help="seconds of silence after which a group is left out"
    )
    p.set_defaults(func=run_lighthouse)


def run_lighthouse(args: argparse.Namespace) -> int:
    bad = [  # only what is wrong, each with what it must be
        f"--min-replicas {args.min_replicas} must be at least 1" if args.min_replicas < 1 else "",
        f"--heartbeat-timeout {args.heartbeat_timeout:g} must be above 0" if not args.heartbeat_timeout > 0 else "",
        f"--port {args.port} must be within 0..65535" if not 0 <= args.port < 65536 else "",
    ]
    if any(bad):
        print(f"tessera lighthouse: error: {'; '.join(b for b in bad if b)}", file=sys.stderr)
        return 2
    from tessera.parallel.fault_tolerance import quiet_torchft  # lazy: it imports torch, as torchft does

    quiet_torchft()  # quorums at INFO otherwise: a line each step
    try:
        from torchft._torchft import LighthouseServer  # lazy: the ft extra
    except ImportError:
        print("tessera lighthouse: error: needs torchft: pip install -e '.[ft]' (torchft 0.2.0)", file=sys.stderr)
        return 2
    try:
        server = LighthouseServer(
            bind=f"[::]:{args.port}",
            min_replicas=args.min_replicas,
            join_timeout_ms=1000,
            quorum_tick_ms=100,
            heartbeat_timeout_ms=int(args.heartbeat_timeout * 1000),
        )
    except Exception as e:  # noqa: BLE001 - torchft's bind error, said in one line
        print(f"tessera lighthouse: error: cannot listen on port {args.port} ({e}); pick another", file=sys.stderr)
        return 2
    return serve(server)


def serve(server: object) -> int:
    """Answer the replica groups until SIGINT or SIGTERM."""
    print(
        f"tessera lighthouse: {server.address()} (pass --lighthouse {server.address()} to every replica "  # type: ignore[attr-defined]
        f"group); "
        f"Ctrl-C or SIGTERM stops it",
        flush=True,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.shutdown()  # type: ignore[attr-defined]
    return 0
