"""The rendezvous of a strata job: torchrun's static rendezvous, with its store listening on one
address only.

torchrun's TCPStore binds every interface (`*:PORT`) whatever host name it is given, and the store
is unauthenticated: anyone who reaches the port can read and overwrite the rendezvous keys, and the
launcher unpickles some of what it reads. So strata opens the listening socket itself, bound to the
one address the job uses (127.0.0.1 for a local run; the master's address on the job's network for
`strata launch`), and hands it to the store (`master_listen_fd`). Everything else about the
rendezvous is torchrun's static one: node ranks as given, the workers share the agent's store."""

from __future__ import annotations

import ipaddress
import socket
from datetime import timedelta

from torch.distributed import PrefixStore, TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
)
from torch.distributed.elastic.rendezvous.registry import handler_registry
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

BACKEND = "strata"
JOIN_TIMEOUT_S = 600  # how long a node waits for the master's store (torchrun's static default)


def listening_socket(address: str, port: int) -> socket.socket:
    """A TCP socket listening on `address` only (port 0: any free port)."""
    family = socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((address, port))
    sock.listen(1024)
    return sock


class BoundStaticRendezvous(RendezvousHandler):
    """Node `rank` of `world_size`; node 0 hosts the store on `address`:`port`, the others connect."""

    def __init__(self, address: str, port: int, rank: int, world_size: int, run_id: str, timeout_s: int):
        self.address, self.port, self.rank, self.world_size = address, port, rank, world_size
        self.run_id, self.timeout = run_id, timedelta(seconds=timeout_s)
        self._store: TCPStore | None = None

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return True  # the workers connect to this store as clients: no listener of their own

    def next_rendezvous(self) -> RendezvousInfo:
        if self._store is None:
            if self.rank == 0:
                sock = listening_socket(self.address, self.port)
                self.port = sock.getsockname()[1]
                self._store = TCPStore(self.address, self.port, self.world_size, True, self.timeout,
                                       multi_tenant=True, master_listen_fd=sock.detach())
            else:
                self._store = TCPStore(self.address, self.port, self.world_size, False, self.timeout,
                                       multi_tenant=True)
        return RendezvousInfo(PrefixStore(self.run_id, self._store), self.rank, self.world_size,
                              RendezvousStoreInfo(self.address, self.port))

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self.run_id

    def shutdown(self) -> bool:
        return True


def _create_handler(params: RendezvousParameters) -> RendezvousHandler:
    address, port = parse_rendezvous_endpoint(params.endpoint, -1)
    return BoundStaticRendezvous(address, port, int(params.config["rank"]), params.max_nodes, params.run_id,
                                 int(params.config.get("timeout", JOIN_TIMEOUT_S)))


def register() -> None:
    """Make `--rdzv-backend strata` known to torchrun in this process (idempotent)."""
    handler_registry.register(BACKEND, _create_handler)
