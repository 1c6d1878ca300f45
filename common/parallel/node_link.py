"""The control link between node 0 (the driver) and each other node of a multi-node instance:
commands, KV write jobs and replies, pickled over one TCP connection per node
(multiprocessing.connection), with a heartbeat both ways.

Either side that has heard nothing for --node-timeout seconds (a dead process, a cut link, a
frozen host) declares the other lost, once. A node that loses the driver stops its ranks at once;
the driver gives it lost_grace_s more before it fails what waited on that node, so that by then
none of its ranks still writes into decode's pages (see ParallelRunner._node_lost).

A loaded host is not a lost one. The link reads on a thread that does nothing else (what a
message asks runs on another, so a handler waiting on a busy rank never stops the link from
hearing its peer) and judges silence on a third, in seconds, not missed beats, by what the
kernel saw (TCP_INFO), not only what this process read:
- the peer's bytes that reached this host count as heard, read or not (this process was the one
  not scheduled for a while);
- a peer that is silent while its host still acknowledges our beats is alive and its link up,
  only its process is not scheduled (a host loaded past its cores, a GIL held long): it is lost
  only after PATIENCE times the timeout;
- a cut link or a frozen host acknowledges nothing: lost after the timeout, once our bytes have
  waited unacknowledged (sent or, behind a route to nothing, not even that) from one look to the
  next (a beat apart at least: on a live link an acknowledgement takes a round trip, whatever
  the peer's process does); a dead process closes its socket: lost at once.

The link trusts its network as torch.distributed's rendezvous does: keep PORT and PORT + 1 of
--dist-init-addr on the cluster's own network.
"""
from __future__ import annotations

import fcntl
import logging
import multiprocessing.connection as mpc
import os
import queue
import socket
import struct
import termios
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from common.parallel.cluster import rendezvous_port_error
from common.runner.layout import ParallelConfigError

logger = logging.getLogger(__name__)

BEATS_PER_SILENCE = 6
PATIENCE = 5  # x the timeout: a peer whose host answers but whose process says nothing
_AUTHKEY = b"pdflash-node-link"  # tells our links from strangers, not a secret


@dataclass(frozen=True)
class Hello:
    """A node's first message: who it is and what instance it thinks it joins."""
    node_rank: int
    host_ip: str
    instance: tuple  # (nnodes, tp, pp, ep, model name, KV pages): must equal the driver's


@dataclass(frozen=True)
class Welcome:
    error: str = ""  # empty: joined


@dataclass(frozen=True)
class RemoteWrite:
    """Driver -> node: a KV write job for one of that node's ranks."""
    rank: int
    job: Any  # common.parallel.worker.WriteJob


def instance_key(nodes, layout, model_name: str, num_pages: int) -> tuple:
    # The KV pages too: with --mem-fraction each node sizes the pool from its own GPUs.
    return nodes.nnodes, layout.tp, layout.pp, layout.ep, model_name, num_pages


def lost_grace_s(silence_s: float) -> float:
    """How long after the driver declares a node lost that node's ranks are surely stopped: the
    node hears nothing either within silence_s (and a beat) of the driver, then kills them."""
    return silence_s + silence_s / BEATS_PER_SILENCE + 1.0


@dataclass(frozen=True)
class _Beat:
    pass


_CLOSED = object()  # ends the handler thread


class Link:
    def __init__(self, conn: mpc.Connection, peer: str, on_message: Callable[[Any], None],
                 on_lost: Callable[[str], None], silence_s: float):
        self.peer = peer  # for messages: "node 1 (10.0.0.2)"
        self._conn = conn
        self._on_message = on_message
        self._on_lost = on_lost
        self._silence_s = silence_s
        self._beat_s = silence_s / BEATS_PER_SILENCE
        self._send_lock = threading.Lock()
        self._heard = time.monotonic()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Event()
        self._unanswered = False  # at the last look: our bytes waited, no acknowledgement for the timeout

    def start(self) -> None:
        for job in (self._read, self._handle, self._beat, self._watch):
            threading.Thread(target=job, name=f"link{job.__name__} {self.peer}", daemon=True).start()

    def send(self, msg: Any) -> None:
        try:
            with self._send_lock:
                self._conn.send(msg)
        except OSError as e:
            self._lose(f"{self.peer}: link broken ({e})")

    def close(self) -> None:
        self._done.set()  # a link closed on purpose is not lost
        self._inbox.put(_CLOSED)
        self._conn.close()

    def _read(self) -> None:
        while not self._done.is_set():
            try:
                msg = self._conn.recv()
            except (EOFError, OSError, TypeError) as e:  # TypeError: close() took the socket from under recv
                self._lose(f"{self.peer}: link closed ({type(e).__name__})")
                return
            self._heard = time.monotonic()
            if not isinstance(msg, _Beat):
                self._inbox.put(msg)

    def _handle(self) -> None:
        while (msg := self._inbox.get()) is not _CLOSED:
            self._on_message(msg)

    def _beat(self) -> None:
        while not self._done.wait(self._beat_s):
            self.send(_Beat())  # may wait behind a large message: silence is judged elsewhere

    def _watch(self) -> None:
        # Not on the reader: a message cut off half-way blocks recv for good.
        while not self._done.wait(self._beat_s):
            quiet = time.monotonic() - self._heard
            if quiet <= self._silence_s:
                self._unanswered = False
                continue
            try:
                tcp = TcpState.of(self._conn)
            except OSError:  # closed meanwhile: the reader says why
                continue
            quiet = min(quiet, tcp.received_s)
            was_unanswered = self._unanswered
            self._unanswered = tcp.outq > 0 and tcp.acked_s > self._silence_s
            if quiet > PATIENCE * self._silence_s:
                self._lose(f"{self.peer}: no word for {quiet:.1f} s, though its host acknowledges (its process is stuck)")
            elif quiet > self._silence_s and self._unanswered and was_unanswered:
                self._lose(f"{self.peer}: no word for {quiet:.1f} s (dead, or its link is cut)")

    def _lose(self, why: str) -> None:
        if self._done.is_set():
            return
        self._done.set()
        self._inbox.put(_CLOSED)
        self._conn.close()  # the peer, if its process runs at all, learns it at once
        self._on_lost(why)


@dataclass(frozen=True)
class TcpState:
    """What this host's kernel knows of a connection, whatever this process was doing."""
    outq: int  # bytes written, not acknowledged yet (sent or not)
    received_s: float  # since data last came in
    acked_s: float  # since an acknowledgement last came in

    @classmethod
    def of(cls, conn: mpc.Connection) -> "TcpState":
        # Linux: SIOCOUTQ (= TIOCOUTQ); TCP_INFO's tcpi_last_data_recv and tcpi_last_ack_recv (ms) at byte 52
        (outq,) = struct.unpack("i", fcntl.ioctl(conn.fileno(), termios.TIOCOUTQ, b"\0" * 4))
        with socket.socket(fileno=os.dup(conn.fileno())) as sock:
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
        data_ms, ack_ms = struct.unpack_from("II", info, 52)
        return cls(outq, data_ms / 1000, ack_ms / 1000)


def accept_nodes(nodes, instance: tuple, deadline_s: float,
                 link: Callable[[int, mpc.Connection, str], Link]) -> dict[int, Link]:
    """Node 0: wait for every other node's Hello; {node rank: its link, made by `link(node rank,
    connection, its host ip)`}. Each link starts as its node joins: a node that came early hears
    the driver's heartbeats while the others come. Raises TimeoutError naming the nodes that did
    not come, ValueError for one that does not fit (the links started are closed then)."""
    host, port = nodes.control_addr
    try:
        listener = mpc.Listener((host, port), authkey=_AUTHKEY)
    except OSError as e:  # taken since the check at start (check_rendezvous_ports)
        raise ParallelConfigError(rendezvous_port_error(nodes, port, e)) from None
    joined: dict[int, Link] = {}
    errors: list[str] = []

    def accept() -> None:
        while len(joined) < nodes.nnodes - 1:
            try:
                conn = listener.accept()
                hello: Hello = conn.recv()
            except (OSError, EOFError, mpc.AuthenticationError) as e:
                logger.warning("a connection to %s:%d that is not one of our nodes: %s", host, port, e)
                continue
            error = ""
            if hello.instance != instance:
                error = f"node {hello.node_rank} ({hello.host_ip}) was started for {hello.instance}, node 0 for {instance} " \
                        "(nnodes, tp, pp, ep, model, KV pages)"
            elif hello.node_rank in joined or not 0 < hello.node_rank < nodes.nnodes:
                error = f"node rank {hello.node_rank} ({hello.host_ip}) is taken or out of range"
            conn.send(Welcome(error))
            if error:
                errors.append(error)
                return
            joined[hello.node_rank] = link(hello.node_rank, conn, hello.host_ip)
            joined[hello.node_rank].start()
            logger.info("node %d of %d joined from %s", hello.node_rank, nodes.nnodes, hello.host_ip)

    logger.info("waiting up to %.0f s for nodes 1-%d to join on %s:%d", deadline_s, nodes.nnodes - 1, host, port)
    t = threading.Thread(target=accept, name="accept-nodes", daemon=True)
    t.start()
    t.join(deadline_s)
    listener.close()
    if errors or len(joined) < nodes.nnodes - 1:
        for started in joined.values():
            started.close()
    if errors:
        raise ValueError(errors[0])
    if len(joined) < nodes.nnodes - 1:
        missing = sorted(set(range(1, nodes.nnodes)) - set(joined))
        raise TimeoutError(f"node(s) {missing} of {nodes.nnodes} did not join within {deadline_s:.0f} s "
                           f"(they connect to {host}:{port}, PORT + 1 of --dist-init-addr)")
    return joined


def connect_head(nodes, instance: tuple, deadline_s: float) -> mpc.Connection:
    """Another node: connect to node 0, retrying until it is up or the deadline passes."""
    host, port = nodes.control_addr
    deadline = time.monotonic() + deadline_s
    next_note = 0.0
    while True:
        try:
            conn = mpc.Client((host, port), authkey=_AUTHKEY)
            break
        except OSError as e:
            if time.monotonic() > deadline:
                raise TimeoutError(f"node 0 did not answer on {host}:{port} within {deadline_s:.0f} s ({e})") from None
            if time.monotonic() > next_note:
                logger.info("waiting for node 0 on %s:%d (%s)", host, port, e)
                next_note = time.monotonic() + 10
            time.sleep(0.5)
    conn.send(Hello(nodes.node_rank, nodes.host_ip, instance))
    welcome: Welcome = conn.recv()
    if welcome.error:
        raise ValueError(f"node 0 refused this node: {welcome.error}")
    return conn
