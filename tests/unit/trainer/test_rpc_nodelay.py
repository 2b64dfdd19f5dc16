"""The trainer RPC connections run with Nagle's algorithm off on both ends (mlrl.trainer.rpc.no_delay)."""

import socket
import threading
from multiprocessing.connection import Client, Listener

from mlrl.trainer.rpc import no_delay, recv, send


def _nodelay(conn) -> int:
    sock = socket.socket(fileno=conn.fileno())
    try:
        return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        sock.detach()


def test_both_ends_turn_nagle_off_and_the_connection_still_works():
    key = b"k" * 32
    with Listener(("127.0.0.1", 0), authkey=key) as listener:
        got = {}

        def serve():
            c = listener.accept()
            got["before"] = _nodelay(c)
            no_delay(c)
            got["server"] = _nodelay(c)
            send(c, recv(c) * 2)
            c.close()

        t = threading.Thread(target=serve)
        t.start()
        client = no_delay(Client(listener.address, authkey=key))
        send(client, b"x" * 50_000)  # over 16 KiB: length and body are two writes
        assert recv(client) == b"x" * 100_000
        assert _nodelay(client) != 0
        client.close()
        t.join(10)
    assert got["before"] == 0 and got["server"] != 0
