"""deploy/pd.sh COMMAND [PROFILE] [KEY=VALUE ...]: run a pdflash experiment on its nodes.

Commands:
  all     start, smoke request, benchmark, collect logs, stop (results/<RUN_ID>/)
  start   start the stack (P -> D -> router, each healthy before the next)
  bench   benchmark; reuses the stack of RUN_ID when it is up with the same settings, else starts it
  logs    collect every service's log into results/<RUN_ID>/logs
  stop    stop the stack (router -> D -> P) and record what is left on each node
  status  health of every service of the run
  restart start the named services of the run again and wait until they are up, e.g. the lost
          node of an instance over several nodes: deploy/pd.sh restart [PROFILE] NAME...
          (names as `status` lists them; the instance's other nodes wait for it, docs/DEPLOY.md)

PROFILE: a name in deploy/profiles/ or a path to an .env file (default: $PROFILE, else the
profile the run was started with). KEY=VALUE overrides a setting of deploy/config.env.
Environment: RUN_ID (default: a new id for start/all, else the active run); DRY_RUN=1 prints
every command for every node and runs none (also --dry-run).
Exit codes: 0 ok; 2 refused settings or bad arguments; 3 another stack is in the way;
otherwise the exit code of the failed command.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from pdeploy import guards
from pdeploy.config import REPO_ROOT, ConfigError, load_config, profile_path, read_env_file
from pdeploy.runner import Runner, StepFailed
from pdeploy.steps import ACTIVE, Deployment
from pdeploy.topology import build_topology

COMMANDS = ("all", "start", "bench", "logs", "stop", "status", "restart")


def _usage(message: str) -> int:
    print(f"deploy/pd.sh: {message}\n\n{__doc__}", file=sys.stderr)
    return 2


def _results_dir(environ) -> Path:
    base = environ.get("RESULTS_DIR") or read_env_file(REPO_ROOT / "deploy" / "config.env")["RESULTS_DIR"]
    return Path(REPO_ROOT, base)


def _select(command: str, profile: str | None, environ) -> tuple[str, str | None]:
    """(RUN_ID, profile) from the arguments, the environment and results/ACTIVE."""
    results = _results_dir(environ)
    run_id = environ.get("RUN_ID", "")
    active = read_env_file(results / ACTIVE) if (results / ACTIVE).is_file() else {}
    if not run_id and command not in ("all", "start"):
        run_id = active.get("RUN_ID", "")
    if not profile and run_id:
        run_env = results / run_id / "metadata" / "run.env"
        profile = read_env_file(run_env).get("PROFILE") if run_env.is_file() else None
    if not run_id:
        if command not in ("all", "start", "bench"):
            raise ConfigError("no run is up (no results/ACTIVE): give RUN_ID=...")
        run_id = f"{Path(profile or 'run').stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    if not run_id.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise ConfigError(f"RUN_ID={run_id!r}: use letters, digits, '-', '_' and '.' only")
    return run_id, profile


def main(argv: list[str], environ=os.environ) -> int:
    dry = environ.get("DRY_RUN", "") not in ("", "0", "false", "no") or "--dry-run" in argv
    argv = [a for a in argv if a != "--dry-run"]
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(__doc__)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        return _usage(f"unknown command {command!r}")
    sets = dict(a.split("=", 1) for a in rest if "=" in a)
    positional = [a for a in rest if "=" not in a]
    names = []  # restart: the services, i.e. the arguments that name no profile
    if command == "restart":
        names = [a for a in positional if not profile_path(a).is_file()]
        positional = [a for a in positional if a not in names]
        if not names:
            return _usage("restart: which services? e.g. deploy/pd.sh restart prefill0-rank1")
    if len(positional) > 1:
        return _usage(f"one profile at most, got {positional}")
    try:
        run_id, profile = _select(command, positional[0] if positional else environ.get("PROFILE"), environ)
        if not profile:
            return _usage("which profile? give it as an argument or PROFILE=...")
        cfg = load_config(profile, environ, sets)
        topo = build_topology(cfg, container=cfg["LAUNCHER"] == "compose")
        errors = guards.check(cfg, topo)
    except ConfigError as e:
        print(f"deploy/pd.sh: error: {e}", file=sys.stderr)
        return 2
    if errors:
        print("deploy/pd.sh: refused:\n" + "".join(f"  - {e}\n" for e in errors), file=sys.stderr, end="")
        return 2
    run_dir = Path(REPO_ROOT, cfg["RESULTS_DIR"], run_id)
    runner = Runner(dry, None if command == "status" else run_dir)
    runner.note(f"deploy/pd.sh {command}: profile {profile}, RUN_ID={run_id}{', DRY_RUN' if dry else ''}")
    runner.note(f"{cfg['MODE']} via {cfg['LAUNCHER']}, {len(topo.services)} services on {len(topo.nodes())} nodes, "
                f"stack digest {cfg.stack_digest()}")
    for k, v in cfg.overrides.items():
        runner.note(f"override {k}={v}")
    dep = Deployment(cfg, topo, run_id, runner)
    if command == "status":
        return 0 if dep.status() or dry else 1
    steps = {"all": ["start", "smoke", "bench", "logs", "stop"], "bench": ["start", "bench"]}.get(command, [command])
    return _run_steps(dep, runner, steps, command, names)


def _run_steps(dep: Deployment, runner: Runner, steps: list[str], command: str, names: list[str]) -> int:
    done: list[str] = []
    for step in steps:
        runner.begin(step)
        t0 = time.monotonic()
        try:
            getattr(dep, step)(*([names] if step == "restart" else []))
            runner.log_step(step, 0, time.monotonic() - t0)
            done.append(step)
        except (StepFailed, KeyboardInterrupt) as e:
            rc = e.rc if isinstance(e, StepFailed) else 130
            msg = str(e) or "interrupted"
            runner.log_step(step, rc, time.monotonic() - t0, msg)
            runner.note(f"step {step} FAILED (exit {rc}): {msg}")
            if command == "all":
                _clean_up(dep, runner, step)
            runner.note(f"results: {dep.results}; resume with: RUN_ID={dep.run_id} deploy/pd.sh "
                        f"{'bench' if step in ('smoke', 'bench') else command} {dep.cfg.profile}")
            return rc
    runner.note(f"done: {' '.join(done)}; results in {dep.results}")
    return 0


def _clean_up(dep: Deployment, runner: Runner, failed: str) -> None:
    """After a failed step of `all`: always the logs; the stack stops unless KEEP_ON_FAILURE=1
    (and a stack that did not even start is always stopped)."""
    keep = dep.cfg["KEEP_ON_FAILURE"] == "1" and failed != "start"
    for step in ["logs"] + ([] if keep else ["stop"]):
        runner.begin(f"{step} (after the failure)")
        t0 = time.monotonic()
        try:
            getattr(dep, step)()
            runner.log_step(step, 0, time.monotonic() - t0)
        except (StepFailed, KeyboardInterrupt) as e:
            runner.log_step(step, getattr(e, "rc", 130), time.monotonic() - t0, str(e))
            runner.note(f"{step} failed too: {e}")
    if keep:
        runner.note(f"KEEP_ON_FAILURE=1: the stack stays up; stop it with RUN_ID={dep.run_id} deploy/pd.sh stop")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
