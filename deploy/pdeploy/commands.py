"""Every action of a deployment as one shell command, exactly as DRY_RUN prints it and as it runs
(`bash -c`, from the repository root).

Where a command runs: `local` as is; `netns:NAME` under `ip netns exec NAME`; anything else over
ssh. How a service runs: LAUNCHER=compose (a container from deploy/compose/<role>.yml plus the
overlays) or LAUNCHER=process (a background process with a pid file, local/netns nodes only).
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass

from pdeploy.config import Config
from pdeploy.topology import Node, Service

IMAGE_DEPLOY_DIR = "/opt/pdflash/deploy"  # where the images keep deploy/ (Dockerfile)
HEALTH_KIND = {"metadata": "tcp", "router": "http"}  # workers: grpc


@dataclass(frozen=True)
class Cmd:
    text: str  # the whole shell text, heredoc and redirections included
    check: bool = True  # a non-zero exit fails the step


def quote(command: str) -> str:
    """Shell-quote a remote command readably: '...' unless it holds single quotes, then "..."
    when nothing in it is special inside double quotes, else shlex.quote."""
    if "'" not in command:
        return f"'{command}'"
    if not any(c in command for c in '$`"\\!'):
        return f'"{command}"'
    return shlex.quote(command)


def on(cfg: Config, node: Node, command: str, stdin: str | None = None, out: str | None = None,
       check: bool = True) -> Cmd:
    """`command` run on `node`; `stdin` fed as a heredoc; stdout+stderr into the local file `out`."""
    if node.kind == "local":
        text = f"{{ {command}; }}" if out and (";" in command or "&&" in command or "|" in command) else command
    elif node.kind == "netns":
        text = f"ip netns exec {node.target.split(':', 1)[1]} bash -c {quote(command)}"
    else:
        text = f"{cfg['SSH']} {node.target} {quote(command)}"
    if stdin is not None:
        text += " <<'EOF'\n" + stdin + ("" if stdin.endswith("\n") else "\n") + "EOF"
        if out:  # a redirection after a heredoc goes on the first line
            head, _, rest = text.partition("\n")
            text = f"{head} > {out} 2>&1\n{rest}"
    elif out:
        text += f" > {out} 2>&1"
    return Cmd(text, check)


def local(command: str, check: bool = True) -> Cmd:
    return Cmd(command, check)


class Launcher:
    """The commands of one service's life: prepare, start, alive, healthy, logs, stop."""

    def __init__(self, cfg: Config, run_id: str):
        self.cfg = cfg
        self.run_id = run_id
        self.results = f"{cfg['RESULTS_DIR']}/{run_id}"

    def health_probe(self, s: Service) -> str:
        if not s.head:
            return "none"
        return f"{HEALTH_KIND.get(s.role, 'grpc')} {s.addr}"


class ComposeLauncher(Launcher):
    def workdir(self, s: Service) -> str:
        return f"{self.cfg['REMOTE_DIR']}/{self.run_id}/{s.name}"

    def files(self, s: Service) -> list[str]:
        overlays = [o.strip() for o in self.cfg["COMPOSE_OVERLAYS"].split(",") if o.strip()]
        return [f"{s.role}.yml"] + ([f"{o}.yml" for o in overlays] if s.role in ("prefill", "decode", "replica") else [])

    def node_env(self, s: Service) -> str:
        lines = {
            "PDFLASH_NAME": s.name, "IMAGE": self.cfg["IMAGE"], "MODEL_DIR": self.cfg["MODEL_DIR"],
            "SHM_SIZE": self.cfg["SHM_SIZE"], "CACHE_DIR": self.cfg["CACHE_DIR"], "START_PERIOD": self.cfg["START_PERIOD"],
            "HEALTH_CHECK": self.health_probe(s), "PDFLASH_ARGS": shlex.join(s.args),
        }
        lines.update(self.cfg.service_env())
        return "".join(f"{k}={v}\n" for k, v in lines.items())

    def _compose(self, s: Service, action: str) -> str:
        fs = " ".join(f"-f {f}" for f in self.files(s))
        return f"cd {self.workdir(s)} && {self.cfg['COMPOSE']} -p pdflash-{s.name} --env-file node.env {fs} {action}"

    def prepare(self, s: Service) -> list[Cmd]:
        d = self.workdir(s)
        srcs = " ".join(f"deploy/compose/{f}" for f in ["common.yml"] + self.files(s))
        if s.node.kind == "ssh":
            copy = local(f"{self.cfg['SCP']} {srcs} {s.node.target}:{d}/")
        else:
            copy = on(self.cfg, s.node, f"cp {srcs} {d}/")
        return [on(self.cfg, s.node, f"mkdir -p {d}"), copy,
                on(self.cfg, s.node, f"cat > {d}/node.env", stdin=self.node_env(s))]

    def start(self, s: Service) -> list[Cmd]:
        return [on(self.cfg, s.node, self._compose(s, "up -d"))]

    def alive(self, s: Service) -> Cmd:
        return on(self.cfg, s.node, f"docker inspect -f {{{{.State.Running}}}} pdflash-{s.name} | grep -qx true")

    def healthy(self, s: Service) -> Cmd:
        return on(self.cfg, s.node, f"docker inspect -f {{{{.State.Health.Status}}}} pdflash-{s.name} | grep -qx healthy")

    def logs(self, s: Service) -> list[Cmd]:
        return [on(self.cfg, s.node, f"docker logs -t pdflash-{s.name}", out=f"{self.results}/logs/{s.name}.log", check=False)]

    def stop(self, s: Service) -> list[Cmd]:
        return [on(self.cfg, s.node, self._compose(s, f"down -t {self.cfg['STOP_TIMEOUT']}"))]

    def leftovers(self, node: Node) -> Cmd:
        """What is still allocated on `node` after stop (recorded in metadata/)."""
        cmd = ("docker ps -a --filter name=pdflash- --format '{{.Names}} {{.Status}}'; "
               "nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader 2>/dev/null || true")
        return on(self.cfg, node, cmd, out=f"{self.results}/metadata/after-stop-{node.label}.txt", check=False)

    def client(self, router: Service, args: str) -> str:
        return f"docker exec pdflash-{router.name} python {IMAGE_DEPLOY_DIR}/tools/client.py {args}"

    def pdflash(self, router: Service, args: str) -> str:
        return f"docker exec pdflash-{router.name} pdflash {args}"


class ProcessLauncher(Launcher):
    def pidfile(self, s: Service) -> str:
        return f"{self.results}/pids/{s.name}.pid"

    def prepare(self, s: Service) -> list[Cmd]:
        return [local(f"mkdir -p {self.results}/logs {self.results}/pids")]

    def start(self, s: Service) -> list[Cmd]:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.cfg.service_env().items())
        cmd = (f"{env + ' ' if env else ''}PYTHONUNBUFFERED=1 setsid {self.cfg['PYTHON']} -m {s.module} {shlex.join(s.args)}"
               f" > {self.results}/logs/{s.name}.log 2>&1 < /dev/null & echo $! > {self.pidfile(s)}")
        if s.role == "metadata":
            cmd = cmd.replace(f"{self.cfg['PYTHON']} -m {s.module}", f"{self.cfg['PYTHON']} -m mooncake.http_metadata_server")
        return [on(self.cfg, s.node, cmd)]

    def alive(self, s: Service) -> Cmd:
        return local(f"kill -0 $(cat {self.pidfile(s)})")

    def healthy(self, s: Service) -> Cmd:
        return on(self.cfg, s.node, f"{self.cfg['PYTHON']} deploy/tools/healthcheck.py {self.health_probe(s)}")

    def logs(self, s: Service) -> list[Cmd]:
        return [local(f"tail -n 3 {self.results}/logs/{s.name}.log", check=False)]

    def stop(self, s: Service) -> list[Cmd]:
        # SIGTERM (the services stop cleanly), wait up to STOP_TIMEOUT, then SIGKILL to the process
        # group `setsid` made for it: the service and whatever it started (rank processes and their
        # forkserver), also those a service killed or crashed half-way left behind; nothing else.
        pid, t = self.pidfile(s), self.cfg.get_int("STOP_TIMEOUT")
        return [local(f"if [ -f {pid} ]; then p=$(cat {pid}); kill -TERM $p 2>/dev/null; "
                      f"for i in $(seq {t * 5}); do kill -0 $p 2>/dev/null || break; sleep 0.2; done; "
                      f"kill -KILL -- -$p 2>/dev/null; rm -f {pid}; fi; true")]

    def leftovers(self, node: Node, ports: list[int]) -> Cmd:
        filt = " or ".join(f"sport = :{p}" for p in ports)
        return on(self.cfg, node, f"ss -Hltn '( {filt} )'",
                  out=f"{self.results}/metadata/after-stop-{node.label}.txt", check=False)

    def client(self, router: Service, args: str) -> str:
        return f"{self.cfg['PYTHON']} deploy/tools/client.py {args}"

    def pdflash(self, router: Service, args: str) -> str:
        return f"{self.cfg['PYTHON']} -m common.tools.cli {args}"


def launcher(cfg: Config, run_id: str) -> ComposeLauncher | ProcessLauncher:
    return ComposeLauncher(cfg, run_id) if cfg["LAUNCHER"] == "compose" else ProcessLauncher(cfg, run_id)
