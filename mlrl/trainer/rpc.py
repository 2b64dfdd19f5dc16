"""The wire between the driver (mlrl.trainer.driver.group) and the trainer ranks
(mlrl.trainer.rank.service): length-prefixed pickles over an HMAC-authenticated
`multiprocessing.connection`, the per-job token passed through the environment (never argv).

A call is `(method name, kwargs)`; a reply is `("ok", value)` or `("err", traceback)`. The
method name is produced only by `TrainerGroup.call` from a `TrainerService` method object, so
callers never spell method names as strings.
"""

from __future__ import annotations

import pickle
from multiprocessing.connection import Connection
from typing import Any

TOKEN_ENV = "MLRL_TRAINER_TOKEN"


def send(conn: Connection, obj: Any) -> None:
    """Plain pickle, not Connection.send: with torch imported, multiprocessing's ForkingPickler
    would pass tensor storages as file descriptors, which only works between related processes."""
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def recv(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())
