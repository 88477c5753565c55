"""Fresh store keys for every process group torchft's Manager configures, across lighthouse restarts.

torchft names a quorum's rendezvous keys by the id its lighthouse gave the quorum
(`HOST:PORT/torchft/{quorum_id}/{group_rank}` in the primary group's store), and a restarted lighthouse numbers
its quorums from 1 again. Two failures follow, both seen on CPU with the launcher's lighthouse drill: a group
configures onto the keys an earlier quorum of the same id left in that store (its gloo pairs dial dead peers),
and a group whose new quorum carries the id it already holds does not reconfigure while its peer does (an 8 s
stall, then a group lost). `FreshQuorums`, wrapped around the Manager's client, makes both impossible:

- a group reconfigures when its quorum's (id, members) changed, or when it must heal or send its state (within
  one lighthouse's life that is a new quorum anyway; across a restart it is the one sign every member sees);
- each configuration's keys live under a generation its members agree on through the primary's store: how many
  times these members configured this id there before (each adds 1 once; the count divided by the members).
"""

from __future__ import annotations

import hashlib
from datetime import timedelta
from typing import Any

GENERATION_KEY = "tessera/quorum_generation"


class _Quorum:
    """torchft's quorum result with the store address replaced (every other field read through)."""

    def __init__(self, quorum: Any, store_address: str) -> None:
        self._quorum, self.store_address = quorum, store_address

    def __getattr__(self, name: str) -> Any:
        return getattr(self._quorum, name)


class FreshQuorums:
    """A stand-in for `manager._client` (torchft 0.2.0's ManagerClient): every call read through, the quorum's
    store address given a generation prefix, and the Manager told to reconfigure when the rules above say so."""

    def __init__(self, manager: Any, group_rank: int, timeout: timedelta) -> None:
        for name in ("_client", "_quorum_id"):
            if not hasattr(manager, name):
                raise RuntimeError(
                    f"torchft's Manager has no {name} (tessera pins torchft 0.2.0, whose quorum ids it makes "
                    f"fresh): pip install -e '.[ft]'"
                )
        self._manager, self._client, self._group_rank, self._timeout = manager, manager._client, group_rank, timeout
        self._configured: tuple[int, tuple[str, ...]] | None = None
        self._address = ""
        self.reconfigured = 0  # how many process groups this rank configured (a test reads it)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def _quorum(self, **kwargs: Any) -> _Quorum:
        quorum = self._client._quorum(**kwargs)
        members = tuple(quorum.replica_ids)
        must = bool(quorum.heal) or bool(quorum.recover_dst_replica_ranks)
        if (quorum.quorum_id, members) != self._configured or must:
            self._configured = (quorum.quorum_id, members)
            generation = self._generation(quorum.store_address, quorum.quorum_id, members)
            self._address = f"{quorum.store_address}/tessera/{generation}"
            self._manager._quorum_id = -1  # torchft reconfigures whenever the id differs from the one it holds
            self.reconfigured += 1
        return _Quorum(quorum, self._address)

    def _generation(self, store_address: str, quorum_id: int, members: tuple[str, ...]) -> str:
        # lazy: torch.distributed's store, only when a fault-tolerant rank reconfigures
        from torch.distributed import TCPStore

        host, _, port = store_address.rpartition(":")
        store = TCPStore(host.strip("[]"), int(port), is_master=False, wait_for_workers=False, timeout=self._timeout)
        digest = hashlib.sha1("\n".join(members).encode()).hexdigest()[:16]
        count = store.add(f"{GENERATION_KEY}/{quorum_id}/{self._group_rank}/{digest}", 1)
        return f"{quorum_id}.{(count - 1) // len(members)}.{digest}"
