"""deploy/: profiles, guards, the commands DRY_RUN prints (golden files), the compose files
(`docker-compose config`, Debian package docker-compose), and the client/health tools.

Regenerate the golden files after an intended change:  UPDATE_GOLDEN=1 pytest tests/test_deploy.py
"""
from __future__ import annotations

import http.server
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "deploy"))

from pdeploy.__main__ import main as pd_main  # noqa: E402
from pdeploy.commands import Cmd, ComposeLauncher, on, quote  # noqa: E402
from pdeploy.config import load_config, read_env_file  # noqa: E402
from pdeploy.topology import Node, build_topology  # noqa: E402

PROFILES = sorted(p.stem for p in (REPO / "deploy" / "profiles").glob("*.env"))
GOLDEN = REPO / "tests" / "golden" / "deploy"
CLEAN_ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}


def dry_run(command: str, profile: str, *sets: str, **env: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    environ = {**CLEAN_ENV, "DRY_RUN": "1", "RUN_ID": "golden", **env}
    with redirect_stdout(out), redirect_stderr(err):
        rc = pd_main([command, profile, *sets], environ)
    return rc, out.getvalue(), err.getvalue()


def config(profile: str, **sets: str):
    cfg = load_config(profile, CLEAN_ENV, sets)
    return cfg, build_topology(cfg, container=cfg["LAUNCHER"] == "compose")


# ---- golden dry runs -----------------------------------------------------------------------------

@pytest.mark.parametrize("profile", PROFILES)
def test_dry_run_all_matches_golden(profile):
    rc, out, err = dry_run("all", profile)
    assert rc == 0, err
    golden = GOLDEN / f"{profile}-all.txt"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(out)
    assert golden.is_file(), f"no golden file {golden}; run with UPDATE_GOLDEN=1"
    assert out == golden.read_text(), f"DRY_RUN output of {profile} changed; UPDATE_GOLDEN=1 if intended"


def test_dry_run_through_pd_sh_touches_nothing(tmp_path):
    env = {**CLEAN_ENV, "DRY_RUN": "1", "RUN_ID": "golden"}
    runs = [subprocess.run([str(REPO / "deploy" / "pd.sh"), "all", "cpu-local", f"RESULTS_DIR={tmp_path}/results"],
                           env=env, capture_output=True, text=True, cwd="/") for _ in range(2)]
    assert runs[0].returncode == 0, runs[0].stderr
    assert runs[0].stdout == runs[1].stdout  # no timestamps, no randomness
    assert not (tmp_path / "results").exists(), "DRY_RUN must not create anything"
    lines = runs[0].stdout.replace(f"{tmp_path}/results", "results").splitlines(keepends=True)
    assert "".join(l for l in lines if not l.startswith("# override RESULTS_DIR")) == (GOLDEN / "cpu-local-all.txt").read_text()


def test_dry_run_start_order_and_waits():
    rc, out, _ = dry_run("all", "pd-8node")
    assert rc == 0
    # P (all 4 nodes) -> wait P head healthy -> D -> wait D head healthy -> router -> wait router
    marks = ["-p pdflash-prefill0-rank3 ", "wait until prefill0-rank0 is healthy", "-p pdflash-decode0-rank0 ",
             "wait until decode0-rank0 is healthy", "-p pdflash-router ", "wait until router is healthy",
             "==== smoke", "==== bench", "==== logs", "==== stop"]
    positions = [out.index(m) for m in marks]
    assert positions == sorted(positions)
    stop = out[out.index("==== stop"):]
    assert stop.index("pdflash-router ") < stop.index("pdflash-decode0-rank0 ") < stop.index("pdflash-prefill0-rank0 ")
    # every node is reached over ssh, every command of every node is printed
    for n in range(1, 9):
        assert f"gpu0{n} 'cd /tmp/pdflash/golden/" in out
    assert out.count("up -d") == 9 and out.count(" down -t 60") == 9


def test_dry_run_flags_per_profile():
    _, out, _ = dry_run("start", "pd-8node")
    assert "--tp 4 --pp 8 --ep 4 --mem-fraction 0.85 --spec dflash" in out
    assert "--tp 32 --ep 4 --mem-fraction 0.88 --spec dflash" in out
    assert "--mooncake-protocol rdma --mooncake-devices mlx5_0,mlx5_1,mlx5_2,mlx5_3" in out
    assert "--nnodes 4 --node-rank 3 --dist-init-addr 10.10.0.5:29502" in out
    assert "--policy pd --prefill 10.10.0.1:31000 --decode 10.10.0.5:32000" in out
    _, out, _ = dry_run("start", "dp2-tp32-dflash")
    assert "--policy round_robin --replicas 10.10.0.1:33000,10.10.0.5:33001" in out
    assert "--role colocated" in out and "--mem-fraction 0.83 --spec dflash" in out
    assert "--mooncake" not in out  # replicas start no transfer engine
    _, out, _ = dry_run("start", "dp2-tp32")
    assert "--mem-fraction 0.85 --spec none" in out


def test_draft_dtype_reaches_prefill_and_decode_alike():
    """P and D hold the draft KV alike: DRAFT_DTYPE goes to both roles (empty: each resolves auto)."""
    _, topo = config("pd-8node", DRAFT_DTYPE="bf16")
    roles = {s.role for s in topo.services if "--draft-dtype bf16" in " ".join(s.args)}
    assert roles == {"prefill", "decode"}
    _, topo = config("pd-8node")
    assert not any("--draft-dtype" in s.args or "--draft-refine" in s.args for s in topo.services)
    _, topo = config("pd-8node", DRAFT_REFINE="0")
    assert {s.role for s in topo.services if "--draft-refine 0" in " ".join(s.args)} == {"prefill", "decode"}


def test_cpu_profile_uses_only_flags_the_services_have():
    from decode_svc.__main__ import parse_args as decode_args
    from prefill_svc.__main__ import parse_args as prefill_args
    from router_svc.config import parse_args as router_args

    _, topo = config("cpu-local")
    parsers = {"prefill": prefill_args, "decode": decode_args, "router": router_args}
    assert sorted(s.role for s in topo.services) == ["decode", "prefill", "router"]
    for s in topo.services:
        parsers[s.role](list(s.args))  # argparse exits on an unknown flag


def test_status_dry_run_and_bench_reuse_note():
    rc, out, _ = dry_run("status", "cpu-local")
    assert rc == 0 and "healthcheck.py grpc 127.0.0.1:31000" in out and "healthcheck.py http 127.0.0.1:30000" in out
    rc, out, _ = dry_run("bench", "dp2-tp32", "BENCH_TOOL=builtin")
    assert rc == 0 and "==== start" in out and "client.py warm --url http://10.10.0.1:30000 --num 2" in out
    assert "client.py bench --url http://10.10.0.1:30000 --input-len 16384" in out and "pdflash bench" not in out


def test_restart_dry_run_touches_only_the_named_services():
    rc, out, _ = dry_run("restart", "pd-8node", "prefill0-rank1")
    assert rc == 0, out
    assert "down -t" in out and "up -d" in out and "wait until prefill0-rank1 is running" in out
    assert "pdflash-prefill0-rank1" in out and not any(f"pdflash-{s}" in out for s in ("prefill0-rank0", "decode0", "router"))
    rc, out, _ = dry_run("restart", "pd-8node", "prefill9-rank0")
    assert rc == 2 and "no service prefill9-rank0 in this stack" in out


def test_failed_start_is_recorded_and_cleaned_up(tmp_path):
    """A service that dies during start-up fails `all` at once (not at START_TIMEOUT); the step's
    exit code is recorded, the logs collected, the stack stopped."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sets = [f"RESULTS_DIR={tmp_path}", "PYTHON=false", f"PREFILL_PORT={port}", f"DECODE_PORT={port + 1}",
            f"ROUTER_PORT={port + 2}", "START_TIMEOUT=60"]
    r = subprocess.run([str(REPO / "deploy" / "pd.sh"), "all", "cpu-local", *sets], capture_output=True, text=True,
                       env={**CLEAN_ENV, "RUN_ID": "broken"}, timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "step start FAILED (exit 1): prefill0 is healthy: the service exited during start-up" in r.stdout
    assert "-m decode_svc" not in r.stdout  # D never starts without a healthy P
    steps = [json.loads(line) for line in (tmp_path / "broken" / "metadata" / "steps.jsonl").read_text().splitlines()]
    assert [(s["step"], s["rc"]) for s in steps] == [("start", 1), ("logs", 0), ("stop", 0)]
    assert not (tmp_path / "ACTIVE").exists()
    assert (tmp_path / "broken" / "commands" / "01-start.sh").read_text().count("setsid false -m prefill_svc") == 1


# ---- guards ------------------------------------------------------------------------------------------

def refused(profile: str, *sets: str, **env: str) -> str:
    rc, out, err = dry_run("all", profile, *sets, **env)
    assert rc == 2 and out == "", (rc, out, err)
    return err


def test_guard_expandable_segments_with_mooncake():
    err = refused("cpu-local", "PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:512, expandable_segments:True")
    assert "Mooncake cannot register memory from expandable segments" in err
    # also when it comes from the shell that runs pd.sh
    assert "expandable" in refused("pd-8node", PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    assert "expandable" in refused("pd-8node", "PYTORCH_ALLOC_CONF=expandable_segments:true")
    # no Mooncake in round robin: allowed; and expandable_segments:False is fine
    assert dry_run("all", "dp2-tp32", "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")[0] == 0
    assert dry_run("all", "pd-8node", "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False")[0] == 0


def test_guard_decode_memory_fraction_copied_to_replica():
    err = refused("dp2-tp32-dflash", "REPLICA_MEM_FRACTION=0.88")
    assert "REPLICA_MEM_FRACTION" in err and "DECODE_MEM_FRACTION=0.88" in err
    err = refused("dp2-tp32", "REPLICA_MEM_FRACTION=0.86", "DECODE_MEM_FRACTION=")
    assert "COLOCATED_MEM_FRACTION_MAX=0.85" in err
    assert "0.9" in refused("dp2-tp32", "REPLICA_EXTRA_ARGS=--mem-fraction 0.9")
    assert "expected a number in (0, 1)" in refused("dp2-tp32", "REPLICA_MEM_FRACTION=83")
    # PD decode nodes keep their higher fraction
    assert dry_run("all", "pd-8node", "DECODE_MEM_FRACTION=0.9")[0] == 0


def test_guard_other_pitfalls():
    assert "MC_TCP_PROTO" in refused("cpu-local", "MC_TCP_PROTO=1")
    assert "MC_FORCE_TCP" in refused("pd-8node", "MC_FORCE_TCP=1")
    assert "PREFILL_TP x PREFILL_PP = 16" in refused("pd-8node", "PREFILL_PP=4")
    assert "LAUNCHER=process runs services on this machine only" in refused("pd-8node", "LAUNCHER=process")
    assert "would both listen on 127.0.0.1:31000" in refused("cpu-local", "DECODE_PORT=31000")


def test_bad_settings_are_clear_errors(tmp_path):
    assert "unknown setting NCCL_IFNAME" in refused("cpu-local", "NCCL_IFNAME=eth0")
    bad = tmp_path / "bad.env"
    bad.write_text("MODE=pd\nPREFIL_NODES=local=127.0.0.1\n")
    assert "unknown key PREFIL_NODES" in refused(str(bad))
    bad.write_text('IMAGE="pdflash:cuda"\n')
    assert "no quotes" in refused(str(bad))
    assert "no profile 'nope'" in refused("nope")
    assert "not a multiple of PREFILL_NODES_PER_INSTANCE=4" in refused("pd-8node", "PREFILL_NODES=a=1.1.1.1")
    assert "MODE=pd needs DECODE_NODES" in refused("cpu-local", "DECODE_NODES=")


def test_config_layers_and_digest():
    cfg, _ = config("cpu-local")
    assert cfg["DEVICE"] == "cpu" and cfg["START_PERIOD"] == "1800s"  # from the profile; the default
    env = {**CLEAN_ENV, "CHUNK_SIZE": "256", "UNRELATED": "x"}
    over = load_config("cpu-local", env, {"BENCH_NUM": "3"})
    assert over.overrides == {"BENCH_NUM": "3", "CHUNK_SIZE": "256"}
    # client settings do not change the stack's identity; stack settings do
    assert load_config("cpu-local", CLEAN_ENV, {"BENCH_NUM": "3", "SMOKE_EXPECT": "x"}).stack_digest() == cfg.stack_digest()
    assert over.stack_digest() != cfg.stack_digest()
    assert cfg.service_env() == {"GLOG_minloglevel": "1", "PDFLASH_LOG_LEVEL": "INFO"}


def test_env_files_have_one_format():
    for path in [REPO / "deploy" / "config.env", *(REPO / "deploy" / "profiles").glob("*.env")]:
        read_env_file(path)  # raises on quotes, interpolation, non KEY=VALUE lines


# ---- commands ------------------------------------------------------------------------------------------

def test_command_wrapping():
    cfg, _ = config("pd-8node")
    assert on(cfg, Node("local", "1.2.3.4"), "a; b", out="f").text == "{ a; b; } > f 2>&1"
    assert on(cfg, Node("netns:n1", "1.2.3.4"), "echo $x").text == "ip netns exec n1 bash -c 'echo $x'"
    ssh = on(cfg, Node("u@gpu01", "1.2.3.4"), "cat > f", stdin="A=1\n", out="o")
    assert ssh.text == "ssh -o BatchMode=yes -o ConnectTimeout=10 u@gpu01 'cat > f' <<'EOF' > o 2>&1\nA=1\nEOF"
    assert quote("echo 'a b'") == "\"echo 'a b'\"" and quote("echo '$x'") == "'echo '\"'\"'$x'\"'\"''"
    r = subprocess.run(["bash", "-c", Cmd(on(cfg, Node("local", "x"), "cat", stdin="hello\n").text).text],
                       capture_output=True, text=True)
    assert r.stdout == "hello\n"


def test_topology_instances_and_ports():
    cfg, topo = config("dp2-tp32")
    heads = topo.heads("replica")
    assert [(s.name, s.addr) for s in heads] == [("replica0-rank0", "10.10.0.1:33000"), ("replica1-rank0", "10.10.0.5:33001")]
    assert len(topo.role("replica")) == 8 and topo.instances == 2
    assert topo.router.args[:4] == ("--host", "10.10.0.1", "--port", "30000")


def test_multi_node_instances_meet_on_ports_of_their_own():
    """Every instance over several nodes meets on two ports of node 0 (torch.distributed's
    rendezvous, the nodes' control link): two instances whose node 0 shares a host, two replicas
    here, would join each other's. Each gets its own pair, and a pair that another service of the
    stack listens on is refused."""
    shared_head = "a=10.0.0.1,b=10.0.0.2,a=10.0.0.1,c=10.0.0.3"  # both replicas' node 0 on 10.0.0.1
    sets = [f"REPLICA_NODES={shared_head}", "REPLICA_NODES_PER_INSTANCE=2", "REPLICA_TP=16"]
    _, topo = config("dp2-tp32", **dict(s.split("=", 1) for s in sets))
    init = {s.name: s.args[s.args.index("--dist-init-addr") + 1] for s in topo.role("replica")}
    assert init == {"replica0-rank0": "10.0.0.1:29500", "replica0-rank1": "10.0.0.1:29500",
                    "replica1-rank0": "10.0.0.1:29502", "replica1-rank1": "10.0.0.1:29502"}
    assert dry_run("all", "dp2-tp32", *sets)[0] == 0
    _, topo = config("pd-8node")  # P and D apart: their own pairs all the same
    assert {s.role: s.args[s.args.index("--dist-init-addr") + 1] for s in topo.workers} == \
        {"prefill": "10.10.0.1:29500", "decode": "10.10.0.5:29502"}
    # DIST_PORT 32999: replica0's control link on the port its node 0 serves gRPC on, replica1's
    # rendezvous (32999 + 2) on replica1's
    err = refused("dp2-tp32", *sets, "DIST_PORT=32999")
    assert "replica0's control link and replica0-rank0 would both listen on 10.0.0.1:33000" in err
    assert "replica1's rendezvous and replica1-rank0 would both listen on 10.0.0.1:33001" in err
    # DIST_PORT 30000 beside the router (10.10.0.1:30000, its RouterService on 30001)
    err = refused("dp2-tp32", "DIST_PORT=30000")
    assert "would both listen on 10.10.0.1:30000" in err
    assert "router's gRPC and replica0's control link would both listen on 10.10.0.1:30001" in err


def test_dp2_profiles_differ_only_in_speculation():
    """The users' A/B: the two stacks are the same services on the same nodes and ports, with the
    same flags apart from speculation and the memory fraction."""
    own = ("--spec", "--draft-model", "--spec-block", "--mem-fraction")

    def stack(profile: str) -> tuple[list, list[dict[str, str]]]:
        services, flags = [], []
        for s in config(profile)[1].services:
            words, rest, mine = iter(s.args), [], {}
            for w in words:
                if w in own:
                    mine[w] = next(words)
                else:
                    rest.append(w)
            services.append((s.name, s.node, s.port, rest))
            flags.append(mine)
        return services, flags

    (plain, plain_flags), (dflash, dflash_flags) = stack("dp2-tp32"), stack("dp2-tp32-dflash")
    assert plain == dflash and len(plain) == 9  # two replicas of four nodes, the router
    replica = slice(0, 8)
    assert plain_flags[replica] == [{"--mem-fraction": "0.85", "--spec": "none"}] * 8
    assert dflash_flags[replica] == [{"--mem-fraction": "0.83", "--spec": "dflash", "--draft-model": "/models/Kimi-K3-DFlash",
                                      "--spec-block": "16"}] * 8
    assert plain_flags[8] == dflash_flags[8] == {}  # the router


# ---- compose files ----------------------------------------------------------------------------------------

COMPOSE = shutil.which("docker-compose")
needs_compose = pytest.mark.skipif(COMPOSE is None, reason="docker-compose not installed (apt-get install docker-compose)")


def compose_config(tmp: Path, files: list[str], env: str, service: str = "pdflash") -> dict:
    for f in ["common.yml", *files]:
        shutil.copy(REPO / "deploy" / "compose" / f, tmp / f)
    (tmp / "node.env").write_text(env)
    args = [COMPOSE, "-p", "pdflash-test", "--env-file", "node.env"] + [a for f in files for a in ("-f", f)] + ["config"]
    r = subprocess.run(args, cwd=tmp, capture_output=True, text=True, env={**CLEAN_ENV, "HOME": str(tmp)})
    assert r.returncode == 0, f"{files}: {r.stderr}"
    import yaml  # transformers' dependency; only for reading docker-compose's answer

    return yaml.safe_load(r.stdout)["services"][service]


def _one_per_role(profile: str, **sets: str):
    cfg, topo = config(profile, **sets)
    seen, out = set(), []
    for s in topo.services:
        if (s.role, s.head) not in seen:
            seen.add((s.role, s.head))
            out.append((cfg, s))
    return out


@needs_compose
def test_compose_files_validate_for_every_profile(tmp_path):
    cases = [c for p in PROFILES if p != "cpu-local" for c in _one_per_role(p)]
    cases += _one_per_role("cpu-local", LAUNCHER="compose", PYTHON="python", METADATA_NODE="local=127.0.0.1")
    assert len(cases) == 20  # every (role, head or not) of every profile

    def check(i_case):
        i, (cfg, s) = i_case
        launch = ComposeLauncher(cfg, "golden")
        tmp = tmp_path / f"{i}-{s.name}"
        tmp.mkdir()
        svc = compose_config(tmp, launch.files(s), launch.node_env(s))
        entry = {"prefill": "prefill_svc", "decode": "decode_svc", "replica": "decode_svc", "router": "router_svc"}
        assert svc["entrypoint"][-1] == entry.get(s.role, "mooncake_http_metadata_server")
        assert svc["container_name"] == f"pdflash-{s.name}"
        assert svc["network_mode"] == "host"
        assert sorted(svc["volumes"]) == sorted([f"{cfg['CACHE_DIR']}:/cache:rw", f"{cfg['MODEL_DIR']}:/models:ro"])
        assert svc["environment"]["XDG_CACHE_HOME"] == "/cache"
        assert svc["ulimits"]["memlock"] == -1
        assert svc["healthcheck"]["test"].endswith(launch.health_probe(s))
        assert svc["environment"]["PDFLASH_ARGS"] == " ".join(s.args)  # shlex.join of plain words
        gpu = "gpu" in cfg["COMPOSE_OVERLAYS"] and s.role in ("prefill", "decode", "replica")
        assert ("deploy" in svc) == gpu
        assert ("/dev/infiniband:/dev/infiniband" in svc.get("devices", [])) == gpu
        return s.role

    with ThreadPoolExecutor(4) as pool:
        roles = set(pool.map(check, enumerate(cases)))
    assert roles == {"metadata", "prefill", "decode", "replica", "router"}


@needs_compose
def test_every_compose_file_validates(tmp_path):
    """The role files and overlays are validated above with each profile's real node.env; here
    the shared base on its own, and a missing required setting."""
    names = sorted(p.name for p in (REPO / "deploy" / "compose").glob("*.yml"))
    assert names == ["common.yml", "decode.yml", "gpu.yml", "metadata.yml", "prefill.yml", "rdma.yml", "replica.yml",
                     "router.yml"]
    env = "PDFLASH_NAME=x\nIMAGE=pdflash:cuda\nMODEL_DIR=/data/models\nCACHE_DIR=/var/cache/pdflash\nPDFLASH_ARGS=--port 1\nHEALTH_CHECK=none\n"
    svc = compose_config(tmp_path, ["common.yml"], env, service="base")
    assert svc["image"] == "pdflash:cuda" and svc["command"] == "--port 1"
    shutil.copy(REPO / "deploy" / "compose" / "prefill.yml", tmp_path)
    (tmp_path / "node.env").write_text(env.replace("IMAGE=pdflash:cuda\n", ""))
    r = subprocess.run([COMPOSE, "--env-file", "node.env", "-f", "prefill.yml", "config"], cwd=tmp_path,
                       capture_output=True, text=True)
    assert r.returncode != 0 and "IMAGE is not set" in r.stderr


# ---- tools ------------------------------------------------------------------------------------------------

class FakeRouter(http.server.BaseHTTPRequestHandler):
    """/health and /generate (plain and streamed, cumulative output_ids like the router)."""

    def log_message(self, *a):
        pass

    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = body["sampling_params"]["max_new_tokens"]
        prompt = body.get("input_ids") or body["text"].split()
        if body.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for i in range(1, n + 1):
                event = {"text": "x" * i, "output_ids": list(range(i)), "meta_info": {"prompt_tokens": len(prompt)}}
                self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            self.wfile.write(b"data: [DONE]\n\n")
            return
        out = json.dumps({"text": " Paris." if n else "", "output_ids": [1, 2][:n], "meta_info": {}}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)


@pytest.fixture
def fake_router():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeRouter)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def tool(name: str, *args: str) -> tuple[int, str]:
    r = subprocess.run([sys.executable, str(REPO / "deploy" / "tools" / name), *args], capture_output=True, text=True)
    return r.returncode, r.stdout


def test_client_smoke_warm_bench(fake_router):
    url = f"http://{fake_router}"
    rc, out = tool("client.py", "smoke", "--url", url, "--expect", "Paris")
    assert rc == 0 and json.loads(out)["text"] == " Paris."
    assert tool("client.py", "smoke", "--url", url, "--expect", "Lyon")[0] == 1
    rc, out = tool("client.py", "warm", "--url", url, "--num", "3")
    assert rc == 0 and json.loads(out)["succeeded"] == 3
    rc, out = tool("client.py", "bench", "--url", url, "--input-len", "32", "--output-len", "5", "--num", "6",
                   "--concurrency", "3")
    summary = json.loads(out)
    assert rc == 0 and summary["succeeded"] == 6 and summary["failed"] == 0
    assert all(r["output_tokens"] == 5 and r["prompt_tokens"] == 32 for r in summary["requests"])
    assert summary["ttft_s"]["p50"] <= summary["e2e_s"]["p50"] and summary["output_tok_s"] > 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    rc, out = tool("client.py", "smoke", "--url", dead)
    assert rc == 1 and not json.loads(out)["ok"]


def test_healthcheck_tool(fake_router):
    assert tool("healthcheck.py", "http", fake_router)[0] == 0
    assert tool("healthcheck.py", "tcp", fake_router)[0] == 0
    assert tool("healthcheck.py", "none")[0] == 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    for kind in ("grpc", "http", "tcp"):
        assert tool("healthcheck.py", kind, dead, "1")[0] == 1
