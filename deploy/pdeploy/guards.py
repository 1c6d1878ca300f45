"""Settings we already paid for (../shared/BRIEF.md, "Pitfalls"): refused before anything starts,
each with the reason and the fix."""
from __future__ import annotations

from pdeploy.config import Config
from pdeploy.topology import Topology, parse_nodes


def check(cfg: Config, topo: Topology) -> list[str]:
    """Every problem found, as one message each; empty when the deployment may start."""
    errors: list[str] = []
    mooncake = cfg["MODE"] == "pd"  # colocated replicas start no transfer engine
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        if mooncake and _expandable_segments(cfg.values.get(var, "")):
            errors.append(
                f"{var}={cfg[var]} with Mooncake (MODE=pd): Mooncake cannot register memory from "
                "expandable segments ('Bad address', Mooncake issue 2511). Remove expandable_segments:True.")
    if cfg["MC_TCP_PROTO"]:
        errors.append(f"MC_TCP_PROTO={cfg['MC_TCP_PROTO']}: bytes came back wrong in a probe with it; leave it empty.")
    if cfg["MOONCAKE_PROTOCOL"] not in ("tcp", "rdma"):
        errors.append(f"MOONCAKE_PROTOCOL={cfg['MOONCAKE_PROTOCOL']!r}: expected tcp or rdma.")
    if mooncake and cfg["MOONCAKE_PROTOCOL"] == "rdma" and cfg["MC_FORCE_TCP"]:
        errors.append("MOONCAKE_PROTOCOL=rdma but MC_FORCE_TCP is set: Mooncake would use TCP. "
                      "Set MOONCAKE_PROTOCOL=tcp, or empty MC_FORCE_TCP.")
    errors += _memory_fractions(cfg)
    errors += _shapes(cfg)
    if cfg["LAUNCHER"] not in ("compose", "process"):
        errors.append(f"LAUNCHER={cfg['LAUNCHER']!r}: expected compose or process.")
    remote = sorted({s.node.target for s in topo.services if s.node.kind == "ssh"})
    if cfg["LAUNCHER"] == "process" and remote:
        errors.append(f"LAUNCHER=process runs services on this machine only (local or netns: nodes), "
                      f"not on {', '.join(remote)}; use LAUNCHER=compose for ssh nodes.")
    if cfg["SPEC"] not in ("", "none", "dflash"):
        errors.append(f"SPEC={cfg['SPEC']!r}: expected none or dflash (or empty).")
    seen: dict[tuple[str, int], str] = {}
    for ip, port, who in _listening(topo):
        other = seen.setdefault((ip, port), who)
        if other != who:
            errors.append(f"{who} and {other} would both listen on {ip}:{port}; change a *_PORT or DIST_PORT.")
    return errors


def _listening(topo: Topology) -> list[tuple[str, int, str]]:
    """(address, port, who) of every port a service of the stack binds that the stack chooses."""
    found = []
    for s in topo.services:
        found.append((s.node.ip, s.port, s.name))
        if s.role == "router":  # its RouterService: --grpc-port, by default the HTTP port + 1
            grpc = _flag_value(" ".join(s.args), "--grpc-port")
            found.append((s.node.ip, int(grpc) if grpc.isdigit() else s.port + 1, "router's gRPC"))
        if s.dist_port and s.head:
            found.append((s.node.ip, s.dist_port, f"{s.instance_name}'s rendezvous"))
            found.append((s.node.ip, s.dist_port + 1, f"{s.instance_name}'s control link"))
    return found


def _expandable_segments(conf: str) -> bool:
    # Same rule as the services' own check (common.transfer.mooncake.check_allocator_env).
    for option in conf.split(","):
        key, _, value = option.partition(":")
        if key.strip() == "expandable_segments" and value.strip().lower() == "true":
            return True
    return False


def _memory_fractions(cfg: Config) -> list[str]:
    errors = []
    for role in ("PREFILL", "DECODE", "REPLICA"):
        value = cfg[f"{role}_MEM_FRACTION"]
        if value and not _fraction(value):
            errors.append(f"{role}_MEM_FRACTION={value}: expected a number in (0, 1).")
    if cfg["MODE"] != "round_robin":
        return errors
    replica = _flag_value(cfg["REPLICA_EXTRA_ARGS"], "--mem-fraction") or cfg["REPLICA_MEM_FRACTION"]
    decode, ceiling = cfg["DECODE_MEM_FRACTION"], cfg["COLOCATED_MEM_FRACTION_MAX"]
    why = ("a colocated replica also prefills (a whole chunk's activations, the MoE workspace) and needs "
           "more headroom than a decode-only node (the users' DFlash replica OOMed at 0.86, passed at 0.83). "
           "Lower REPLICA_MEM_FRACTION.")
    if _fraction(replica) and _fraction(decode) and float(replica) >= float(decode):
        errors.append(f"colocated replica memory fraction {replica} is not below DECODE_MEM_FRACTION={decode} "
                      f"(a decode-only fraction copied to a replica?): {why}")
    elif _fraction(replica) and _fraction(ceiling) and float(replica) > float(ceiling):
        errors.append(f"colocated replica memory fraction {replica} is above COLOCATED_MEM_FRACTION_MAX={ceiling}: {why}")
    return errors


def _flag_value(args: str, flag: str) -> str:
    words = args.split()
    for i, w in enumerate(words):
        if w == flag and i + 1 < len(words):
            return words[i + 1]
        if w.startswith(flag + "="):
            return w.split("=", 1)[1]
    return ""


def _fraction(value: str) -> bool:
    try:
        return 0.0 < float(value) < 1.0
    except ValueError:
        return False


def _shapes(cfg: Config) -> list[str]:
    """Decode instances and replicas do not pipeline; on GPUs, TP x PP of an instance must fill
    its nodes' GPUs exactly."""
    errors = [f"{role}_PP={cfg[f'{role}_PP']}: only prefill instances split into pipeline stages; "
              f"leave it empty or 1." for role in ("DECODE", "REPLICA") if cfg[f"{role}_PP"] not in ("", "1")]
    if cfg["DEVICE"] != "cuda":
        return errors
    roles = ("PREFILL", "DECODE") if cfg["MODE"] == "pd" else ("REPLICA",)
    for role in roles:
        if not (cfg[f"{role}_TP"] or cfg[f"{role}_PP"]):
            continue
        tp, pp = cfg[f"{role}_TP"] or "1", cfg[f"{role}_PP"] or "1"
        if not (tp.isdigit() and pp.isdigit()):
            errors.append(f"{role}_TP={tp} / {role}_PP={pp}: expected positive integers.")
            continue
        per, gpus = cfg[f"{role}_NODES_PER_INSTANCE"], cfg["GPUS_PER_NODE"]
        if not parse_nodes(f"{role}_NODES", cfg[f"{role}_NODES"]) or not (per.isdigit() and gpus.isdigit()):
            continue
        if int(tp) * int(pp) != int(per) * int(gpus):
            errors.append(f"{role}_TP x {role}_PP = {int(tp) * int(pp)} GPUs, but an instance has "
                          f"{role}_NODES_PER_INSTANCE x GPUS_PER_NODE = {int(per) * int(gpus)}.")
    return errors
