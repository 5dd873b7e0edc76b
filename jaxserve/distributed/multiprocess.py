"""Several processes, one model: `jax.distributed` and the step channel.

Every process holds its own devices' shards of the params and the KV pool and runs the
same compiled steps on them (SPMD: a step's collectives need every process to launch it,
in the same order). Process 0 runs the HTTP server, the scheduler and the engine loop;
before it launches a step on its devices it sends the step's host inputs (the shape key,
the flat ragged batch and the sampling parameters: a few KB) to the other processes over
one TCP connection each, and they launch the same step on theirs. That is one small
message per step, nothing per token; the sampled tokens are replicated on every device,
so only process 0 reads them.

If a process dies, the others stop within seconds with an error naming it: process 0
watches each follower's connection, a follower its connection to process 0 (and
jax.distributed's heartbeat, `heartbeat_timeout_s`, backs both up).

Flags as sglang-jax names them: `--dist-init-addr HOST:PORT --nnodes N --node-rank R`.
CPU collectives run over gloo (JAX's default), so this runs on one machine with several
local processes.

Source: sglang-jax's multi-node launch (one scheduler, SPMD workers); vLLM's
`broadcast_tensor_dict` of each step's inputs from the driver worker.
"""

from __future__ import annotations

import logging
import pickle
import socket
import struct
import threading
from typing import Any, Callable

log = logging.getLogger(__name__)

_ADDRESS_KEY = "jaxserve/step_channel"
_HEADER = struct.Struct("!Q")


class DistributedError(RuntimeError):
    """A process of a multi-process deployment is gone or unreachable."""


def initialize(dist_init_addr: str, nnodes: int, node_rank: int,
               heartbeat_timeout_s: int = 10, timeout_s: int = 120) -> None:
    """`jax.distributed.initialize` for process `node_rank` of `nnodes`, the coordinator
    (process 0) at `dist_init_addr` ("HOST:PORT"). Call before any JAX computation. Raises
    ValueError naming the flag for a bad address or rank."""
    import jax

    host, _, port = dist_init_addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--dist-init-addr must be HOST:PORT, got {dist_init_addr!r}")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank must be in 0..{nnodes - 1} (--nnodes {nnodes}), "
                         f"got {node_rank}")
    jax.distributed.initialize(dist_init_addr, num_processes=nnodes, process_id=node_rank,
                               heartbeat_timeout_seconds=heartbeat_timeout_s,
                               initialization_timeout=timeout_s)
    log.info("process %d of %d: %d local devices, %d in all", node_rank, nnodes,
             jax.local_device_count(), jax.device_count())


def _kv_client():
    from jax._src import distributed
    client = distributed.global_state.client
    if client is None:
        raise DistributedError("jax.distributed is not initialised")
    return client


def _send(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_HEADER.pack(len(payload)) + payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


class StepChannel:
    """Process 0's side (`lead`) or a follower's (`follow`) of the step broadcast."""

    def __init__(self, socks: dict[int, socket.socket], rank: int):
        self._socks = socks
        self.rank = rank
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def lead(cls, num_processes: int, host: str, on_lost: Callable[[int], None],
             timeout_s: float = 120.0) -> "StepChannel":
        """Process 0: listen on `host` (a free port, published through jax.distributed's
        key-value store), accept the other num_processes - 1 processes, and watch each
        connection: `on_lost(rank)` is called (on a watcher thread) when one closes.
        Raises DistributedError when they do not all connect within timeout_s."""
        server = socket.create_server((host, 0))
        server.settimeout(timeout_s)
        _kv_client().key_value_set(_ADDRESS_KEY, f"{host}:{server.getsockname()[1]}")
        socks = {}
        try:
            while len(socks) < num_processes - 1:
                conn, _ = server.accept()
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                (rank,) = struct.unpack("!I", _recv_exact(conn, 4) or b"\0\0\0\0")
                socks[rank] = conn
        except socket.timeout:
            raise DistributedError(f"only {len(socks) + 1} of {num_processes} processes joined "
                                   f"the step channel within {timeout_s:.0f} s") from None
        finally:
            server.close()
        channel = cls(socks, 0)
        for rank, conn in socks.items():
            threading.Thread(target=channel._watch, args=(rank, conn, on_lost),
                             name=f"jaxserve-watch-{rank}", daemon=True).start()
        log.info("step channel: %d followers connected", len(socks))
        return channel

    @classmethod
    def follow(cls, rank: int, timeout_s: float = 120.0) -> "StepChannel":
        """A follower: connect to process 0's channel (its address from the key-value
        store). Raises DistributedError when it cannot."""
        addr = _kv_client().blocking_key_value_get(_ADDRESS_KEY, int(timeout_s * 1000))
        host, _, port = addr.rpartition(":")
        try:
            sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        except OSError as e:
            raise DistributedError(f"cannot reach process 0's step channel at {addr}: {e}") from e
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(struct.pack("!I", rank))
        return cls({0: sock}, rank)

    def _watch(self, rank: int, conn: socket.socket, on_lost: Callable[[int], None]) -> None:
        """Process 0: followers never write; a read returns only when one is gone."""
        try:
            data = conn.recv(1)
        except OSError:
            data = b""
        if not data and not self._closed:
            on_lost(rank)

    def send(self, record: Any) -> None:
        """Process 0: send `record` (picklable) to every follower. Raises DistributedError
        naming a follower that is gone."""
        payload = pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            for rank, sock in self._socks.items():
                try:
                    _send(sock, payload)
                except OSError as e:
                    raise DistributedError(f"process {rank} is gone ({e})") from e

    def recv(self) -> Any:
        """A follower: the next record. Raises DistributedError when process 0 is gone."""
        sock = self._socks[0]
        head = _recv_exact(sock, _HEADER.size)
        body = head and _recv_exact(sock, _HEADER.unpack(head)[0])
        if not body:
            raise DistributedError("process 0 closed the step channel (it exited or died)")
        return pickle.loads(body)

    def stop(self) -> None:
        """Process 0, shutting down: tell the followers to stop (they exit once their
        last step is done), then close. Their closing connections are expected now, not
        reported as lost."""
        self._closed = True
        try:
            self.send(("stop",))
        except DistributedError as e:
            log.warning("stopping the followers: %s", e)
        self.close()

    def close(self) -> None:
        self._closed = True
        for sock in self._socks.values():
            try:
                sock.close()
            except OSError:
                pass
