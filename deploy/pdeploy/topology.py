"""Which service runs on which node with which flags.

A role (metadata, prefill, decode, replica, router) has instances; an instance spans one or more
nodes (its first node is the head: it serves gRPC, the others join via torch.distributed). Every
(instance, node) pair is one Service: one container or process.
"""
from __future__ import annotations

from dataclasses import dataclass

from pdeploy.config import Config, ConfigError

# Start order: P owns the bootstrap, so P before D before the router (BRIEF pitfalls).
ROLE_ORDER = ("metadata", "prefill", "decode", "replica", "router")
WORKER_MODULE = {"prefill": "prefill_svc", "decode": "decode_svc", "replica": "decode_svc"}
CONTAINER_MODEL_DIR = "/models"


@dataclass(frozen=True)
class Node:
    target: str  # "local", "netns:NAME" or an ssh destination
    ip: str  # compute-network address

    @property
    def kind(self) -> str:
        if self.target == "local":
            return "local"
        return "netns" if self.target.startswith("netns:") else "ssh"

    @property
    def label(self) -> str:  # for file names: no '@', ':' or '/'
        return self.target.replace("netns:", "netns-").replace("@", "_").replace("/", "_")


@dataclass(frozen=True)
class Service:
    role: str
    instance: int
    rank: int  # node rank inside the instance; 0 = head
    nnodes: int
    node: Node
    port: int
    args: tuple[str, ...]  # the service's command-line flags
    dist_port: int = 0  # an instance over several nodes: node 0's rendezvous (PORT) and control link (PORT + 1)

    @property
    def instance_name(self) -> str:
        return f"{self.role}{self.instance}" if self.role not in ("router", "metadata") else self.role

    @property
    def name(self) -> str:  # unique within a stack, stable across runs
        return self.instance_name if self.nnodes == 1 else f"{self.instance_name}-rank{self.rank}"

    @property
    def head(self) -> bool:
        return self.rank == 0

    @property
    def addr(self) -> str:
        return f"{self.node.ip}:{self.port}"

    @property
    def module(self) -> str:
        return WORKER_MODULE.get(self.role, "router_svc")


def parse_nodes(key: str, spec: str) -> list[Node]:
    nodes = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        target, sep, ip = item.rpartition("=")
        if not sep or not target or not ip:
            raise ConfigError(f"{key}: expected NODE=IP entries separated by commas, got {item!r}")
        nodes.append(Node(target, ip))
    return nodes


@dataclass(frozen=True)
class Topology:
    services: tuple[Service, ...]

    def role(self, role: str) -> list[Service]:
        return [s for s in self.services if s.role == role]

    def heads(self, role: str) -> list[Service]:
        return [s for s in self.role(role) if s.head]

    @property
    def router(self) -> Service:
        return self.role("router")[0]

    @property
    def workers(self) -> list[Service]:
        return [s for s in self.services if s.role in WORKER_MODULE]

    def nodes(self) -> list[Node]:
        seen: dict[str, Node] = {}
        for s in self.services:
            seen.setdefault(s.node.target, s.node)
        return list(seen.values())

    @property
    def instances(self) -> int:
        """Instances a warm-up must reach through the router."""
        return max(len(self.heads("prefill")), len(self.heads("decode")), len(self.heads("replica")), 1)


def build_topology(cfg: Config, container: bool) -> Topology:
    """`container`: paths as the services see them inside the image (/models)."""
    mode = cfg["MODE"]
    if mode not in ("pd", "round_robin"):
        raise ConfigError(f"MODE={mode!r}: expected pd or round_robin")
    roles = ["prefill", "decode"] if mode == "pd" else ["replica"]
    services: list[Service] = []
    metadata_url = ""
    if cfg["METADATA_NODE"]:
        (node,) = _nodes_exactly_one(cfg, "METADATA_NODE")
        port = cfg.get_int("METADATA_PORT")
        services.append(Service("metadata", 0, 0, 1, node, port, ("--host", node.ip, "--port", str(port))))
        metadata_url = f"http://{node.ip}:{port}/metadata"
    for role in roles:
        services += _worker_services(cfg, role, container, metadata_url, _next_dist_port(cfg, services))
    (node,) = _nodes_exactly_one(cfg, "ROUTER_NODE")
    port = cfg.get_int("ROUTER_PORT")
    heads = {r: ",".join(s.addr for s in services if s.role == r and s.head) for r in roles}
    args = ["--host", node.ip, "--port", str(port)]
    if mode == "pd":
        args += ["--policy", "pd", "--prefill", heads["prefill"], "--decode", heads["decode"]]
    else:
        args += ["--policy", "round_robin", "--replicas", heads["replica"]]
    args += _model_flag(cfg, container) + ["--request-timeout", cfg["REQUEST_TIMEOUT"]]
    args += _opt("--transfer-deadline", cfg["DEADLINE"]) + cfg["ROUTER_EXTRA_ARGS"].split()
    services.append(Service("router", 0, 0, 1, node, port, tuple(args)))
    return Topology(tuple(services))


def _nodes_exactly_one(cfg: Config, key: str) -> list[Node]:
    nodes = parse_nodes(key, cfg[key])
    if len(nodes) != 1:
        raise ConfigError(f"{key} must name exactly one NODE=IP, got {cfg[key]!r}")
    return nodes


def _model_flag(cfg: Config, container: bool, key: str = "MODEL_NAME", flag: str = "--model") -> list[str]:
    if not cfg[key]:
        return []
    base = CONTAINER_MODEL_DIR if container else cfg["MODEL_DIR"]
    return [flag, f"{base.rstrip('/')}/{cfg[key]}"]


def _opt(flag: str, value: str) -> list[str]:
    return [flag, value] if value else []


def _next_dist_port(cfg: Config, services: list[Service]) -> int:
    """The rendezvous port of the next instance over several nodes: each takes two (PORT, PORT + 1)
    of its own, so instances whose node 0 shares a host (replicas, or P and D, placed so) never
    join each other's group."""
    return max((s.dist_port + 2 for s in services if s.dist_port), default=cfg.get_int("DIST_PORT"))


def _worker_services(cfg: Config, role: str, container: bool, metadata_url: str, dist_port: int) -> list[Service]:
    key = role.upper()
    nodes = parse_nodes(f"{key}_NODES", cfg[f"{key}_NODES"])
    per = cfg.get_int(f"{key}_NODES_PER_INSTANCE")
    if not nodes:
        raise ConfigError(f"MODE={cfg['MODE']} needs {key}_NODES (NODE=IP,...)")
    if per < 1 or len(nodes) % per:
        raise ConfigError(f"{key}_NODES has {len(nodes)} nodes, not a multiple of {key}_NODES_PER_INSTANCE={per}")
    common = (_model_flag(cfg, container) + _opt("--dtype", cfg["DTYPE"]) + _opt("--device", cfg["DEVICE"])
              + _opt("--page-size", cfg["PAGE_SIZE"]) + _opt("--kv-pages", cfg["KV_PAGES"])
              + _opt("--chunk-size", cfg["CHUNK_SIZE"]) + _opt("--deadline", cfg["DEADLINE"]))
    if role == "decode":
        common = ["--role", "decode"] + common + _opt("--max-running", cfg["MAX_RUNNING"])
    elif role == "replica":
        common = ["--role", "colocated"] + common + _opt("--max-running", cfg["MAX_RUNNING"])
    for dim in ("TP", "PP", "EP") if role == "prefill" else ("TP", "EP"):  # decode does not pipeline (guards)
        common += _opt(f"--{dim.lower()}", cfg[f"{key}_{dim}"])
    common += _opt("--mem-fraction", cfg[f"{key}_MEM_FRACTION"])
    if cfg["SPEC"]:
        common += ["--spec", cfg["SPEC"]]
        if cfg["SPEC"] != "none":
            common += _model_flag(cfg, container, "DRAFT_MODEL_NAME", "--draft-model") + _opt("--spec-block", cfg["SPEC_BLOCK"]) \
                + _opt("--draft-dtype", cfg["DRAFT_DTYPE"]) + _opt("--draft-refine", cfg["DRAFT_REFINE"])
    extra = cfg[f"{key}_EXTRA_ARGS"].split()
    services = []
    base_port = cfg.get_int(f"{key}_PORT")
    for i in range(len(nodes) // per):
        group = nodes[i * per:(i + 1) * per]
        port = base_port + i
        dist = dist_port + 2 * i if per > 1 else 0
        for rank, node in enumerate(group):
            args = ["--host", node.ip, "--port", str(port)]
            if role != "replica":  # a colocated replica starts no transfer engine
                args += ["--mooncake-host", node.ip, "--mooncake-protocol", cfg["MOONCAKE_PROTOCOL"]]
                args += _opt("--mooncake-devices", cfg["RDMA_DEVICES"]) + _opt("--mooncake-metadata", metadata_url)
            if per > 1:
                args += ["--nnodes", str(per), "--node-rank", str(rank),
                         "--dist-init-addr", f"{group[0].ip}:{dist}"]
            services.append(Service(role, i, rank, per, node, port, tuple(args + common + extra), dist))
    return services
