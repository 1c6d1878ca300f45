"""The steps of an experiment: start, smoke, bench, logs, stop, status; `all` runs them in turn.

1. start   P -> D -> router (after the metadata service, if any), each group healthy before the
           next; a running stack of the same run with the same settings is reused
2. smoke   one greedy request through the router                  -> bench/smoke.json
3. bench   warm every instance, then the serving benchmark          -> bench/
4. logs    every service's log                                      -> logs/
5. stop    router -> D -> P; what is left on each node afterwards   -> metadata/after-stop-*.txt

`restart NAME...` starts services of a running stack again, e.g. the node an instance lost.
"""
from __future__ import annotations

import shlex
import subprocess
import time
from pathlib import Path

from pdeploy.commands import Cmd, ComposeLauncher, launcher, local, on
from pdeploy.config import REPO_ROOT, Config, read_env_file
from pdeploy.runner import Runner, StepFailed
from pdeploy.topology import ROLE_ORDER, Service, Topology

ACTIVE = "ACTIVE"  # results/ACTIVE: the run whose stack is up (RUN_ID, PROFILE, DIGEST)


class Deployment:
    def __init__(self, cfg: Config, topo: Topology, run_id: str, runner: Runner):
        self.cfg = cfg
        self.topo = topo
        self.run_id = run_id
        self.r = runner
        self.launch = launcher(cfg, run_id)
        self.results = f"{cfg['RESULTS_DIR']}/{run_id}"
        self.url = f"http://{topo.router.addr}"

    # ---- 1. start ------------------------------------------------------------------------------
    def start(self) -> None:
        if not self.r.dry and self._reuse():
            return
        self.r.run(local(f"mkdir -p {self.results}/commands {self.results}/logs {self.results}/bench {self.results}/metadata"))
        if not self.r.dry:
            self._write_metadata()
            # Recorded before anything starts, so that a start failing half-way can be stopped.
            self._active_path().write_text(f"RUN_ID={self.run_id}\nPROFILE={self.cfg.profile}\nDIGEST={self.cfg.stack_digest()}\n")
        for node in self.topo.nodes():
            probe = ("hostname; nproc; free -g | head -2; nvidia-smi -L 2>/dev/null; "
                     "ls /dev/infiniband 2>/dev/null; ip -br addr 2>/dev/null")
            self.r.run(on(self.cfg, node, probe, out=f"{self.results}/metadata/before-{node.label}.txt", check=False))
        for role in ROLE_ORDER:
            self._start_group(self.topo.role(role))
        self.r.note(f"stack up: {self.url}")

    def _start_group(self, group: list[Service]) -> None:
        """Start these services, then wait until each is up."""
        interval, timeout = float(self.cfg["POLL_INTERVAL"]), float(self.cfg["START_TIMEOUT"])
        for s in group:
            self.r.note(f"{s.name} on {s.node.target} ({s.node.ip}), rank {s.rank}/{s.nnodes}")
            for cmd in self.launch.prepare(s) + self.launch.start(s):
                self.r.run(cmd)
        for s in group:
            if s.head:
                self.r.poll(self.launch.healthy(s), self.launch.alive(s), f"{s.name} is healthy", interval, timeout)
            else:  # joins its head through torch.distributed; the head's health covers it
                self.r.poll(self.launch.alive(s), None, f"{s.name} is running", interval, timeout)

    def restart(self, names: list[str]) -> None:
        """Stop what is left of these services and start them again; the rest of the stack stays
        (an instance's surviving nodes wait for a lost one: docs/DEPLOY.md)."""
        by_name = {s.name: s for s in self.topo.services}
        unknown = [n for n in names if n not in by_name]
        if unknown:
            raise StepFailed(f"no service {', '.join(unknown)} in this stack; it has {', '.join(by_name)}", 2)
        group = [by_name[n] for n in names]
        for s in group:
            for cmd in self.launch.stop(s):
                self.r.run(Cmd(cmd.text, check=False))
        self._start_group(group)

    def _reuse(self) -> bool:
        """True when this run's stack is already up with the same settings; refuses a different one."""
        active = self.active()
        if not active:
            return False
        states = self.probe_all()
        up = all(states)
        if active.get("RUN_ID") != self.run_id:
            if any(states):
                raise StepFailed(f"run {active['RUN_ID']} is (partly) up on these nodes; stop it first "
                                 f"(RUN_ID={active['RUN_ID']} deploy/pd.sh stop)", 3)
            return False
        if active.get("DIGEST") != self.cfg.stack_digest() and up:
            recorded = read_env_file(Path(REPO_ROOT, self.results, "metadata", "stack.env"))
            changes = [f"{k}: {recorded.get(k)!r} -> {v!r}" for k, v in self.cfg.stack_items() if recorded.get(k) != v]
            raise StepFailed(f"run {self.run_id} is up with other settings ({'; '.join(changes) or 'config.env changed'}); "
                             "stop it first or run with the same profile and settings", 3)
        if up:
            self.r.note(f"run {self.run_id} is already up with these settings on {self.url}: reusing it")
        else:  # e.g. a start that failed half-way: clear what is left, then start afresh
            self.r.note(f"run {self.run_id} is not (fully) up: stopping what is left of it, then starting again")
            self.stop()
        return up

    def probe_all(self) -> list[bool]:
        """Each service up (head: healthy; other ranks: running)?"""
        return [self.r.check_once(self.launch.healthy(s) if s.head else self.launch.alive(s)) for s in self.topo.services]

    def _write_metadata(self) -> None:
        meta = Path(REPO_ROOT, self.results, "metadata")
        (meta / "stack.env").write_text(self.cfg.dump())
        (meta / "overrides.env").write_text("".join(f"{k}={v}\n" for k, v in self.cfg.overrides.items()))
        (meta / "run.env").write_text(f"RUN_ID={self.run_id}\nPROFILE={self.cfg.profile}\nDIGEST={self.cfg.stack_digest()}\n"
                                      f"STARTED={time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n")
        git = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO_ROOT, capture_output=True, text=True)
        (meta / "git.txt").write_text(git.stdout or git.stderr)
        (meta / "services.txt").write_text("".join(f"{s.name} {s.node.target} {s.addr} {s.module} {shlex.join(s.args)}\n"
                                                   for s in self.topo.services))

    # ---- 2. smoke ------------------------------------------------------------------------------
    def smoke(self) -> None:
        c = self.cfg
        args = (f"smoke --url {self.url} --prompt {shlex.quote(c['SMOKE_PROMPT'])} --max-new-tokens {c['SMOKE_MAX_NEW_TOKENS']}"
                + (f" --expect {shlex.quote(c['SMOKE_EXPECT'])}" if c["SMOKE_EXPECT"] else ""))
        self._client(args, "smoke.json")

    def _client(self, args: str, out: str) -> None:
        router = self.topo.router
        self.r.run(on(self.cfg, router.node, self.launch.client(router, args), out=f"{self.results}/bench/{out}"))

    # ---- 3. bench ------------------------------------------------------------------------------
    def bench(self) -> None:
        c = self.cfg
        warm = int(c["BENCH_WARMUP_PER_INSTANCE"]) * self.topo.instances
        if warm:
            self.r.note(f"warm every instance: {warm} sequential request(s) through the router")
            self._client(f"warm --url {self.url} --num {warm}", "warm.json")
        shape = (f"--input-len {c['BENCH_INPUT_LEN']} --output-len {c['BENCH_OUTPUT_LEN']} "
                 f"--concurrency {c['BENCH_CONCURRENCY']} --num {c['BENCH_NUM']}")
        builtin = f"bench --url {self.url} {shape} --seed {c['BENCH_SEED']}"
        tool = c["BENCH_TOOL"]
        router = self.topo.router
        if tool == "auto":
            probe = on(c, router.node, self.launch.pdflash(router, "bench serving --help") + " > /dev/null 2>&1")
            self.r.note("BENCH_TOOL=auto: `pdflash bench serving` when this succeeds, else deploy/tools/client.py:")
            self.r.say(probe.text)
            if self.r.dry:
                self.r.note("  if it succeeds:")
                self._pdflash_bench(shape)
                self.r.note("  else:")
                self._client(builtin, "summary.json")
                return
            tool = "pdflash" if self.r.check_once(probe) else "builtin"
            self.r.note(f"  -> {tool}")
        if tool == "pdflash":
            self._pdflash_bench(shape)
        elif tool == "builtin":
            self._client(builtin, "summary.json")
        else:
            raise StepFailed(f"BENCH_TOOL={tool!r}: expected auto, builtin or pdflash", 2)

    def _pdflash_bench(self, shape: str) -> None:
        router, bench = self.topo.router, f"{self.results}/bench"
        if isinstance(self.launch, ComposeLauncher):
            inside = f"/tmp/pdflash-bench-{self.run_id}"
            args = f"bench serving --url {self.url} {shape} --warmup --out {inside}"
            self.r.run(on(self.cfg, router.node, self.launch.pdflash(router, args), out=f"{bench}/serving.txt"))
            fetch = on(self.cfg, router.node, f"docker cp pdflash-{router.name}:{inside} -")
            self.r.run(Cmd(f"{fetch.text} | tar -x -C {bench}"))
        else:
            args = f"bench serving --url {self.url} {shape} --warmup --out {bench}/serving"
            self.r.run(on(self.cfg, router.node, self.launch.pdflash(router, args), out=f"{bench}/serving.txt"))

    # ---- 4. logs / 5. stop / status ---------------------------------------------------------------
    def logs(self) -> None:
        self.r.run(local(f"mkdir -p {self.results}/logs"))
        for s in self.topo.services:
            for cmd in self.launch.logs(s):
                self.r.run(cmd)

    def stop(self) -> None:
        self.r.run(local(f"mkdir -p {self.results}/metadata"))
        failed = []  # one unreachable node must not keep the others running: try them all
        for role in reversed(ROLE_ORDER):  # router first: no new work reaches the workers
            for s in self.topo.role(role):
                for cmd in self.launch.stop(s):
                    if self.r.run(Cmd(cmd.text, check=False)):
                        failed.append(s.name)
        self.r.note("what is left on each node (should be nothing):")
        for node in self.topo.nodes():
            if isinstance(self.launch, ComposeLauncher):
                self.r.run(self.launch.leftovers(node))
            else:
                ports = sorted({s.port for s in self.topo.services if s.node == node})
                self.r.run(self.launch.leftovers(node, ports))
        if failed:
            raise StepFailed(f"could not stop {', '.join(failed)}; see the output above, then stop again", 1)
        if not self.r.dry:
            active = self.active()
            if active.get("RUN_ID") == self.run_id:
                self._active_path().unlink()

    def status(self) -> bool:
        self.r.say(f"{'service':<16} {'node':<20} {'address':<22} state")
        ok = True
        for s in self.topo.services:
            probe = self.launch.healthy(s) if s.head else self.launch.alive(s)
            if self.r.dry:
                self.r.say(probe.text)
                continue
            up = self.r.check_once(probe)
            ok &= up
            self.r.say(f"{s.name:<16} {s.node.target:<20} {s.addr:<22} {'healthy' if up else 'DOWN'}")
        active = self.active()
        if active and not self.r.dry:
            same = active.get("RUN_ID") == self.run_id and active.get("DIGEST") == self.cfg.stack_digest()
            self.r.note(f"active run: {active.get('RUN_ID')} ({'same settings' if same else 'DIFFERENT settings'})")
        return ok

    # ---- results/ACTIVE ------------------------------------------------------------------------
    def _active_path(self) -> Path:
        return Path(REPO_ROOT, self.cfg["RESULTS_DIR"], ACTIVE)

    def active(self) -> dict[str, str]:
        p = self._active_path()
        return read_env_file(p) if p.is_file() else {}
