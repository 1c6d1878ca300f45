"""Which hosts an instance's ranks live on (SGLang's --nnodes / --node-rank / --dist-init-addr).

An instance of TP x PP ranks spread over N nodes puts ranks [k * W/N, (k + 1) * W/N) on node k
(W = TP x PP; rank = stage * TP + TP rank, so a node holds whole stages, or a slice of one TP
group when TP spans nodes). Node 0 holds rank 0, the driver, which serves the instance's gRPC.
`dist_init_addr` is node 0's HOST:PORT: torch.distributed's rendezvous on PORT, the nodes'
control link (common.parallel.node_link) on PORT + 1.

Node 0 binds both ports: another instance whose node 0 shares its host needs a pair of its own,
or its nodes would join that instance's group. A pair already taken is refused at start
(`check_rendezvous_ports`), naming the port and the flag.

This host's address (`host_ip`) is what its peers reach it on: its Mooncake segments and its
gloo/NCCL traffic. Unless given, it is the address of the interface that routes toward node 0,
i.e. the compute network, not the management one.
"""
from __future__ import annotations

import errno
import fcntl
import os
import socket
import struct
from dataclasses import dataclass

from common.runner.layout import ParallelConfigError

LOOPBACK = "127.0.0.1"
STARTUP_TIMEOUT_S = 600.0  # for every node and rank of an instance to join (--dist-timeout)
NODE_TIMEOUT_S = 3.0  # without word from a node, it is lost (--node-timeout; common.parallel.node_link)


@dataclass(frozen=True)
class Nodes:
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str = ""  # node 0's HOST:PORT
    host_ip: str = LOOPBACK  # this node's address on the compute network
    timeout_s: float = NODE_TIMEOUT_S  # silence after which a node (or node 0) is lost

    @property
    def multi(self) -> bool:
        return self.nnodes > 1

    @property
    def head(self) -> bool:
        return self.node_rank == 0

    @property
    def init_method(self) -> str:
        return f"tcp://{self.dist_init_addr}"

    @property
    def control_addr(self) -> tuple[str, int]:
        host, port = split_addr(self.dist_init_addr)
        return host, port + 1

    def check(self, world: int) -> None:
        if self.multi and world % self.nnodes:
            raise ParallelConfigError(f"{world} ranks (TP x PP) do not split evenly over --nnodes {self.nnodes}")

    def ranks(self, world: int, node: int | None = None) -> range:
        """The ranks on `node` (default: this one)."""
        per = world // self.nnodes
        node = self.node_rank if node is None else node
        return range(node * per, (node + 1) * per)

    def node_of(self, world: int, rank: int) -> int:
        return rank // (world // self.nnodes)


def local_device(device: str, local_index: int) -> str:
    """The device of this host's local_index-th rank: a GPU each."""
    return f"cuda:{local_index}" if device in ("cuda", "cuda:0") else device


def split_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {addr!r}")
    return host.strip("[]"), int(port)


def make_nodes(nnodes: int, node_rank: int, dist_init_addr: str | None, host_ip: str | None,
               timeout_s: float = NODE_TIMEOUT_S) -> Nodes:
    """Checked multi-node options; ValueError says what is wrong."""
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank must be in [0, --nnodes) and --nnodes at least 1, got {node_rank} of {nnodes}")
    if not timeout_s > 0:
        raise ValueError(f"--node-timeout must be positive, got {timeout_s}")
    if nnodes == 1:
        return Nodes(host_ip=host_ip or LOOPBACK)
    if not dist_init_addr:
        raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address)")
    host, port = split_addr(dist_init_addr)
    if not 0 < port < 65535:
        raise ValueError(f"--dist-init-addr {dist_init_addr}: PORT must be in [1, 65534] (PORT + 1 is the nodes' "
                         "control link)")
    nodes = Nodes(nnodes, node_rank, dist_init_addr, host_ip or route_source(host), timeout_s)
    if nodes.head:
        check_rendezvous_ports(nodes)
    return nodes


def check_rendezvous_ports(nodes: Nodes) -> None:
    """Node 0: ValueError unless it can bind both ports of --dist-init-addr now, before it loads
    anything (its process group's store binds PORT only once every node has joined)."""
    host, port = split_addr(nodes.dist_init_addr)
    # As each binds: torch's store PORT on every address of the host, the control link PORT + 1
    # on HOST alone; a closed connection's TIME_WAIT (an instance that re-forms) does not hold the
    # port, a listener does.
    for addr in (("0.0.0.0", port), (host, port + 1)):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(addr)
            except OSError as e:
                raise ValueError(rendezvous_port_error(nodes, addr[1], e)) from None


def rendezvous_port_error(nodes: Nodes, port: int, e: OSError) -> str:
    host, first = split_addr(nodes.dist_init_addr)
    what = "its rendezvous (PORT)" if port == first else "its nodes' control link (PORT + 1)"
    if e.errno == errno.EADDRINUSE:
        return (f"{host}:{port}, {what} of --dist-init-addr {nodes.dist_init_addr}, is taken: another instance's "
                "node 0 on this host, or another program, listens there. Each instance over several nodes needs two "
                "ports of its own on its node 0: give this one another --dist-init-addr port (deploy/pd.sh: DIST_PORT)")
    return (f"node 0 cannot listen on {host}:{port}, {what} of --dist-init-addr {nodes.dist_init_addr} ({e.strerror}): "
            "it must name an address of node 0's own host")


def route_source(host: str) -> str:
    """This host's address on the interface that routes toward `host` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


def interface_of(ip: str) -> str | None:
    """The name of the interface holding IPv4 address `ip`, or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:  # no IPv4 address
                continue
            if socket.inet_ntoa(packed[20:24]) == ip:
                return name
    return None


def pin_collective_interface(nodes: Nodes) -> None:
    """gloo and NCCL pick an interface from the host name unless told; across hosts that may be
    the management network or an address the peers cannot reach. Point both at host_ip's
    interface, unless the operator already chose (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME)."""
    if not nodes.multi:
        return
    name = interface_of(nodes.host_ip)
    if name is None:
        raise ParallelConfigError(f"no interface of this host holds --host-ip {nodes.host_ip}")
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        os.environ.setdefault(var, name)
