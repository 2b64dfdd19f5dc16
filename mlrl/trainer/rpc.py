"""The wire between the driver (mlrl.trainer.driver.group) and the trainer ranks
(mlrl.trainer.rank.service): length-prefixed pickles over an HMAC-authenticated
`multiprocessing.connection`, the per-job token passed through the environment (never argv).

A call is `(method name, kwargs)`; a reply is `("ok", value)` or `("err", traceback)`. The
method name is produced only by `TrainerGroup.call` from a `TrainerService` method object, so
callers never spell method names as strings.
"""

from __future__ import annotations

import pickle
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    import torch

TOKEN_ENV = "MLRL_TRAINER_TOKEN"


@dataclass
class RankRouterDiagnostics:
    """One rank's part of `mlrl.interfaces.RouterDiagnostics` (its DP rank's micro-batches).

    Every class a `TrainerService` method returns lives outside `mlrl.trainer.rank.service`: that
    module runs as `__main__` on the ranks, so a class defined there pickles as
    `__main__.<name>`, which the driver cannot load."""

    replay: list[torch.Tensor]
    own: list[torch.Tensor]
    matches: int
    compared: int


class _HasFileno(Protocol):
    def fileno(self) -> int: ...


C = TypeVar("C", bound=_HasFileno)


class Wire(Protocol):
    """The two calls `send` / `recv` make (a multiprocessing Connection or PipeConnection)."""

    def send_bytes(self, buf: bytes, /) -> None: ...

    def recv_bytes(self) -> bytes: ...


def no_delay(conn: C) -> C:
    """Turn Nagle's algorithm off on the connection's TCP socket (both ends call this).

    `Connection.send_bytes` writes a message over 16 KiB as two writes, its 4-byte length then
    the body. With Nagle on, a body shorter than one segment waits until the length's segment is
    acknowledged, and the receiver delays that ACK (~40 ms on Linux): measured on the CPU demo, a
    58 KB update request reached the rank ~45 ms after it was sent (driver round trip 0.11 s,
    the rank's own work 0.065 s). The same connection carries every trainer call."""
    sock = socket.socket(fileno=conn.fileno())
    try:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    finally:
        sock.detach()  # the fd stays the Connection's
    return conn


def send(conn: Wire, obj: Any) -> None:
    """Plain pickle, not Connection.send: with torch imported, multiprocessing's ForkingPickler
    would pass tensor storages as file descriptors, which only works between related processes."""
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def recv(conn: Wire) -> Any:
    return pickle.loads(conn.recv_bytes())
