"""The live recovery's wire: a replica that rejoins receives its peer's state (weights, optimizer state, the
schedule, the data position, the RNG) over HTTP, as safetensors bytes beside a JSON tree, never a pickle.

torchft's own transports (HTTP and process-group) unpickle what they receive (`weights_only=False`): whatever a
peer or anything on the network sends would run as code. This one is a torchft `CheckpointTransport` whose
payload is an 8-byte little-endian header length, a UTF-8 JSON tree (tensors replaced by their key), then a
safetensors blob: reading it parses numbers and text only.
"""

from __future__ import annotations

import http.server
import json
import socket
import struct
import threading
import urllib.request
from datetime import timedelta
from typing import Any

from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors
from torch import Tensor

_TENSOR = "__tensor__"


def encode(state: Any) -> bytes:
    """`state` (nested dicts, lists and tuples of tensors, numbers, strings, None) as bytes: JSON + safetensors."""
    tensors: dict[str, Tensor] = {}

    def walk(x: Any) -> Any:
        if isinstance(x, Tensor):
            key = str(len(tensors))
            local = x.to_local() if hasattr(x, "to_local") else x
            tensors[key] = local.detach().to("cpu").contiguous()
            return {_TENSOR: key}
        if isinstance(x, dict):
            if not all(isinstance(k, (str, int)) for k in x):
                raise TypeError(f"replica state: a dict key of type {type(next(iter(x))).__name__}: use str or int")
            return {"__dict__": [[k, walk(v)] for k, v in x.items()]}
        if isinstance(x, (list, tuple)):
            return {"__list__": [walk(v) for v in x], "tuple": isinstance(x, tuple)}
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        raise TypeError(f"replica state: a {type(x).__name__} cannot be sent (tensors, numbers, text and containers)")

    tree = json.dumps(walk(state)).encode()
    return struct.pack("<Q", len(tree)) + tree + save_tensors(tensors)


def decode(payload: bytes) -> Any:
    """The state `encode` wrote; tensors on the CPU."""
    (n,) = struct.unpack("<Q", payload[:8])
    tree = json.loads(payload[8 : 8 + n].decode())
    tensors = load_tensors(payload[8 + n :])

    def walk(x: Any) -> Any:
        if isinstance(x, dict):
            if _TENSOR in x:
                return tensors[x[_TENSOR]]
            if "__dict__" in x:
                return {k: walk(v) for k, v in x["__dict__"]}
            items = [walk(v) for v in x["__list__"]]
            return tuple(items) if x.get("tuple") else items
        return x

    return walk(tree)


def _transport_base() -> type:
    from torchft.checkpointing.transport import CheckpointTransport  # lazy: torchft is the `ft` extra

    return CheckpointTransport


class SafeTransport(_transport_base()):  # type: ignore[misc]
    """Serves this rank's state to a rejoining peer (`send_checkpoint`), and fetches a peer's (`recv_checkpoint`);
    the server answers GET /checkpoint/<step> for the step it was given, 404 otherwise."""

    def __init__(self, timeout: timedelta):
        self.timeout = timeout
        self._payload: tuple[int, bytes] | None = None
        self._ready = threading.Condition()
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
                parts = self.path.strip("/").split("/")
                wanted = parts[1] if len(parts) == 2 and parts[0] == "checkpoint" else None
                with owner._ready:  # the peer may ask before this rank's quorum has handed its state over
                    owner._ready.wait_for(
                        lambda: owner._payload is not None and str(owner._payload[0]) == wanted,
                        timeout=owner.timeout.total_seconds() if wanted is not None else 0,
                    )
                    payload = owner._payload
                if payload is None or wanted != str(payload[0]):
                    self.send_error(404, "no checkpoint of that step here")
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(payload[1])))
                self.end_headers()
                self.wfile.write(payload[1])

            def log_message(self, *args: Any) -> None:  # quiet: the run's lines are its own
                pass

        self._server = http.server.ThreadingHTTPServer(("0.0.0.0", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="tessera-replica-state", daemon=True)
        self._thread.start()

    def metadata(self) -> str:
        return f"http://{socket.gethostname()}:{self._server.server_address[1]}"

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        payload = encode(state_dict)
        with self._ready:
            self._payload = (step, payload)
            self._ready.notify_all()

    def disallow_checkpoint(self) -> None:
        with self._ready:
            self._payload = None

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        with urllib.request.urlopen(f"{metadata}/checkpoint/{step}", timeout=timeout.total_seconds()) as response:
            return decode(response.read())

    def shutdown(self, wait: bool = True) -> None:
        self._server.shutdown()
        self._server.server_close()


def state_bytes(state: Any) -> int:
    """The tensor bytes `encode` would send for `state` (what a recovery moves)."""
    total = 0

    def walk(x: Any) -> None:
        nonlocal total
        if isinstance(x, Tensor):
            local = x.to_local() if hasattr(x, "to_local") else x
            total += local.numel() * local.element_size()
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(state)
    return total
