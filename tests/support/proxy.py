"""A TCP proxy in front of Redis that can lose a reply after Redis executed the command.

This is the fault that makes "at least once" differ from "exactly once": the client's
connection dies after Redis applied a write but before the client read the answer, so
the client cannot tell whether to retry. :meth:`FaultyProxy.drop_reply_after` arms it:
the next client request containing a marker (``b"EXEC"``, ``b"EVALSHA"``) is forwarded,
Redis is given time to execute it, and then both sides of that connection are closed
with the reply discarded.
"""

from __future__ import annotations

import socket
import threading
import time


class FaultyProxy:
    """Listen on 127.0.0.1 (ephemeral port) and forward to ``127.0.0.1:target_port``."""

    def __init__(self, target_port: int, settle_s: float = 0.2):
        self.target = ("127.0.0.1", target_port)
        self.settle_s = settle_s
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self._armed: list[bytes] = []
        self._lock = threading.Lock()
        self.dropped = 0
        self._stop = threading.Event()
        threading.Thread(target=self._accept, name="bdl-faulty-proxy", daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def drop_reply_after(self, marker: bytes, times: int = 1) -> None:
        """Lose the reply to the next ``times`` requests that contain ``marker``."""
        with self._lock:
            self._armed.extend([marker] * times)

    def close(self) -> None:
        self._stop.set()
        self.sock.close()

    def _take(self, data: bytes) -> bool:
        with self._lock:
            for i, m in enumerate(self._armed):
                if m in data:
                    del self._armed[i]
                    return True
        return False

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            cut = threading.Event()
            threading.Thread(target=self._pump_up, args=(client, server, cut), daemon=True).start()
            threading.Thread(target=self._pump_down, args=(server, client, cut), daemon=True).start()

    def _pump_up(self, client: socket.socket, server: socket.socket, cut: threading.Event) -> None:
        """Client -> Redis; on an armed marker, forward it and then cut the connection."""
        try:
            while data := client.recv(65536):
                drop = self._take(data)
                if drop:
                    cut.set()  # from now on nothing Redis says reaches the client
                server.sendall(data)
                if drop:
                    time.sleep(self.settle_s)  # Redis executes it; its reply is never relayed
                    self.dropped += 1
                    break
        except OSError:
            pass
        for s in (client, server):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    @staticmethod
    def _pump_down(server: socket.socket, client: socket.socket, cut: threading.Event) -> None:
        try:
            while data := server.recv(65536):
                if cut.is_set():
                    continue
                client.sendall(data)
        except OSError:
            pass
