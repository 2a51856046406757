"""How hand-off records travel between processes: one-directional links carrying whole frames of bytes.

- `ShmLink` (one host): the sender copies a frame into a fresh POSIX shared-memory segment and sends only
  its name and size through a pipe; the receiver copies it out and unlinks the segment. The payload never
  goes through a pipe's small buffer, and a segment whose receiver died is removed by multiprocessing's
  resource tracker when the front exits.
- `TcpLink` (between hosts, or one host): a plain stream socket; each frame is a little-endian u64 length
  and the bytes.

Both are waitable with `multiprocessing.connection.wait` (`waitable`). On the CPU there is nothing
faster between processes than shared memory; NCCL or CUDA IPC would move GPU-resident blocks between
devices, and are not used here (the payload is exported to host memory first).
"""

from __future__ import annotations

import contextlib
import socket
import struct
from multiprocessing import shared_memory

_LEN = struct.Struct("<Q")


class HandoffLink:
    """One direction of a hand-off channel."""

    def send(self, data: bytes) -> None:
        raise NotImplementedError

    def recv(self) -> bytes:
        """The next frame (blocks until it is whole); EOFError when the peer has gone."""
        raise NotImplementedError

    @property
    def waitable(self):
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class ShmLink(HandoffLink):
    def __init__(self, conn) -> None:
        self.conn = conn  # a multiprocessing Connection (one end of a Pipe)

    def send(self, data: bytes) -> None:
        shm = shared_memory.SharedMemory(create=True, size=max(1, len(data)))
        try:
            shm.buf[: len(data)] = data
            self.conn.send((shm.name, len(data)))
        except BaseException:
            shm.close()
            shm.unlink()
            raise
        shm.close()  # the receiver unlinks it

    def recv(self) -> bytes:
        name, size = self.conn.recv()
        shm = shared_memory.SharedMemory(name=name)
        try:
            return bytes(shm.buf[:size])
        finally:
            shm.close()
            shm.unlink()

    @property
    def waitable(self):
        return self.conn

    def close(self) -> None:
        self.conn.close()


class TcpLink(HandoffLink):
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    @classmethod
    def connect(cls, host: str, port: int, timeout_s: float = 30.0) -> TcpLink:
        return cls(socket.create_connection((host, port), timeout=timeout_s))

    def send(self, data: bytes) -> None:
        self.sock.settimeout(None)
        self.sock.sendall(_LEN.pack(len(data)))
        self.sock.sendall(data)

    def recv(self) -> bytes:
        self.sock.settimeout(None)
        (n,) = _LEN.unpack(self._exactly(_LEN.size))
        return bytes(self._exactly(n))

    def _exactly(self, n: int) -> bytearray:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = self.sock.recv_into(view[got:], n - got)
            if k == 0:
                raise EOFError(f"hand-off peer closed the connection ({got} of {n} bytes read)")
            got += k
        return buf

    @property
    def waitable(self):
        return self.sock

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


class TcpListener:
    """The front's side of a TCP link: a listening socket an engine process connects to."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.sock = socket.create_server((host, 0))
        self.host, self.port = host, self.sock.getsockname()[1]

    def accept(self, timeout_s: float) -> TcpLink:
        self.sock.settimeout(timeout_s)
        try:
            conn, _ = self.sock.accept()
        except TimeoutError as e:
            raise TimeoutError(
                f"no engine connected to {self.host}:{self.port} within {timeout_s:.0f} s"
            ) from e
        finally:
            self.sock.close()
        return TcpLink(conn)


def open_child_link(spec) -> HandoffLink:
    """The engine process's end, from what the front passed it: ("shm", Connection) or ("tcp", host, port)."""
    if spec[0] == "shm":
        return ShmLink(spec[1])
    if spec[0] == "tcp":
        return TcpLink.connect(spec[1], spec[2])
    raise ValueError(f"hand-off transport must be shm or tcp, got {spec[0]!r}")
