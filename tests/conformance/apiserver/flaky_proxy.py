"""A loopback TCP proxy in front of the real kube-apiserver that can cut every connection and refuse new ones: an
API outage as a client sees it (a dead load balancer), for the outage tests of the plugin and the fleet controller.
"""

from __future__ import annotations

import socket
import threading


class FlakyProxy:
    """Pipes loopback TCP connections to an upstream; while down, it cuts every open connection and refuses new ones
    (accept-and-close, what a dead load balancer in front of the API server looks like)."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.up = True
        self.refused = 0
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if not self.up:
                self.refused += 1
                client.close()
                continue
            try:
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns |= {client, server}
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass

    def down(self) -> None:
        self.up = False
        with self._lock:
            conns, self._conns = self._conns, set()
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
                s.close()
            except OSError:
                pass

    def close(self) -> None:
        self.down()
        self.listener.close()
