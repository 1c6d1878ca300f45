"""`pdflash bench transfer`: move one prompt's KV between two processes with Mooncake (TCP) and
compare with a plain loopback TCP socket carrying the same bytes.

The KV is shaped like SmolLM2-135M (30 layers, 3 KV heads, head_dim 64, page size 64). Both
sides hold twice the room's pages, so a room is a slice of each (layer, k/v) block, as in a
serving cache. Both methods copy the transfer plan's entries, from the same source ranges to
the same destination ranges: the socket sends each entry's bytes in plan order and D receives
them straight into their pages. Every timed round is synchronous: a Mooncake write returns after
the peer has acknowledged every entry as applied, and the socket round waits for a 1-byte
acknowledgement sent once the last byte has landed. The two methods alternate round by round.
Bytes are checked with CRC32 for each method on its own after the timed rounds.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import random
import socket
import statistics
import sys
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from protos import pdflash_pb2 as pb

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE = 30, 3, 64, 64  # SmolLM2-135M
REPLY_TIMEOUT_S = 600


@dataclass(frozen=True)
class BenchConfig:
    tokens: int
    dtype: str
    repeats: int
    warmup: int
    shuffle_pages: bool
    host: str

    @property
    def room_pages(self) -> int:
        return -(-self.tokens // PAGE_SIZE)

    @property
    def cache_pages(self) -> int:
        return 2 * self.room_pages


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, default=2048, help="prompt length whose KV is moved")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--repeats", type=int, default=20, help="timed rounds per method")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds per method first")
    parser.add_argument("--shuffle-pages", action="store_true",
                        help="scatter the room's pages so no entries merge (shows the cost of small entries)")
    parser.add_argument("--host", default="127.0.0.1", help="address both processes use")
    parser.add_argument("--out", default="bench-out/transfer.json")


METHODS = ("mooncake_tcp", "plain_tcp")


def run(args: argparse.Namespace) -> int:
    """Prints and saves the result; exit status 1 if the bytes that arrived differ from the source."""
    result = measure(args)
    return 0 if all(result["verified"].values()) else 1


def measure(args: argparse.Namespace) -> dict:
    cfg = BenchConfig(args.tokens, args.dtype, args.repeats, args.warmup, args.shuffle_pages, args.host)
    ctx = mp.get_context("spawn")
    recv_conn, recv_child = ctx.Pipe()
    send_conn, send_child = ctx.Pipe()
    receiver = ctx.Process(target=_receiver_main, args=(recv_child, cfg), daemon=True)
    sender = ctx.Process(target=_sender_main, args=(send_child, cfg), daemon=True)
    receiver.start()
    sender.start()
    try:
        session_id, dst_info, tcp_port = _reply(recv_conn)
        send_conn.send(("plan", session_id, dst_info))
        entries, batches, nbytes, src_crc, dst_ranges = _reply(send_conn)
        recv_conn.send(("sink", dst_ranges))
        _reply(recv_conn)
        send_conn.send(("time", tcp_port))
        times, cpu = _reply(send_conn)
        verified = {m: _verify(m, send_conn, recv_conn, dst_ranges) == src_crc for m in METHODS}
        for conn in (send_conn, recv_conn):
            conn.send(("stop",))
            _reply(conn)
    finally:
        for proc in (sender, receiver):
            proc.join(30)
            if proc.is_alive():
                proc.kill()

    mooncake, tcp = (_summary(times[m], cpu[m], nbytes) for m in METHODS)
    result = {
        "config": asdict(cfg),
        "model_shape": {"layers": NUM_LAYERS, "kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM, "page_size": PAGE_SIZE},
        "bytes": nbytes,
        "entries": entries,
        "batches": batches,
        "mooncake_tcp": mooncake,
        "plain_tcp": tcp,
        "ratio_median": mooncake["median_gbps"] / tcp["median_gbps"],
        "ratio_best": mooncake["best_gbps"] / tcp["best_gbps"],
        "verified": verified,
    }
    print(f"KV of {cfg.tokens} tokens, {cfg.dtype}: {nbytes / 1e6:.1f} MB in {entries} entries ({batches} batches)")
    for name, s in (("mooncake tcp", mooncake), ("plain tcp", tcp)):
        print(f"  {name:13s} median {s['median_gbps']:6.2f} GB/s   best {s['best_gbps']:6.2f} GB/s"
              f"   sender CPU {s['sender_cpu_per_wall']:.2f} s/s")
    print(f"  mooncake / plain: median {result['ratio_median']:.2f}, best {result['ratio_best']:.2f}")
    print(f"  bytes verified: mooncake {verified['mooncake_tcp']}, plain tcp {verified['plain_tcp']}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"saved {args.out}")
    if not all(verified.values()):
        print(f"error: transferred bytes differ from the source: {verified}", file=sys.stderr)
    return result


def _verify(method: str, send_conn: Any, recv_conn: Any, dst_ranges: list[tuple[int, int]]) -> int:
    """Zero D's destination, move the room once more with `method` alone, and return the CRC32
    of what landed: the timed rounds wrote the same bytes with both methods, so checking after
    them could credit one method with the other's copy."""
    recv_conn.send(("clear", dst_ranges))
    _reply(recv_conn)
    send_conn.send(("once", method))
    _reply(send_conn)
    recv_conn.send(("crc", dst_ranges))
    return _reply(recv_conn)


def _summary(times: list[float], cpu_s: float, nbytes: int) -> dict:
    median = statistics.median(times)
    # CPU seconds the sender process (all its threads, Mooncake's TCP thread included) burned
    # per wall second of timed rounds: on a small host, CPU spent waiting is CPU not copying.
    return {"median_gbps": nbytes / median / 1e9, "best_gbps": nbytes / min(times) / 1e9,
            "median_s": median, "sender_cpu_per_wall": cpu_s / sum(times), "times_s": times}


def _reply(conn: Any) -> Any:
    if not conn.poll(REPLY_TIMEOUT_S):
        raise RuntimeError("bench peer process gave no reply")
    status, payload = conn.recv()
    if status != "ok":
        raise RuntimeError(f"bench peer process failed: {payload}")
    return payload


def _kv_cache(cfg: BenchConfig, fill: bool) -> Any:
    import torch

    from common.kv.buffers import PagedKVBuffer

    dtype = getattr(torch, cfg.dtype)
    shape = (NUM_LAYERS, 2, cfg.cache_pages, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM)
    if fill:
        t = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    else:
        t = torch.zeros(shape, dtype=dtype)
    buf = PagedKVBuffer("kv", t.data_ptr(), NUM_LAYERS, cfg.cache_pages, PAGE_SIZE, NUM_KV_HEADS, 0, NUM_KV_HEADS,
                        HEAD_DIM, cfg.dtype)
    return t, buf


def _room_pages(cfg: BenchConfig, side: int) -> list[int]:
    """Pages of the room on P (side 0) or D (side 1)."""
    pages = list(range(cfg.cache_pages))
    if cfg.shuffle_pages:
        random.Random(side).shuffle(pages)
        return pages[: cfg.room_pages]
    return pages[side * cfg.room_pages : (side + 1) * cfg.room_pages]  # P the low half, D the high


def _engine(cfg: BenchConfig, addr: int, length: int) -> Any:
    from common.transfer.mooncake import MooncakeConfig, MooncakeEngine

    engine = MooncakeEngine(MooncakeConfig(local_hostname=cfg.host))
    engine.start()
    engine.register(addr, length)
    return engine


def _view(addr: int, length: int) -> memoryview:
    """Writable bytes at a raw address: the entries' source and destination ranges."""
    return memoryview((ctypes.c_char * length).from_address(addr)).cast("B")


def _receiver_main(conn: Any, cfg: BenchConfig) -> None:
    """D: owns the destination cache, a Mooncake engine and a socket sink."""
    from common.kv.buffers import RoomBuffers
    from common.transfer.wire import room_to_protos

    try:
        cache, buf = _kv_cache(cfg, fill=False)  # named: its memory must outlive every transfer
        engine = _engine(cfg, buf.base_addr, buf.length)
        server = socket.create_server((cfg.host, 0))
        room = RoomBuffers([buf], {"kv": _room_pages(cfg, side=1)})
        conn.send(("ok", (engine.session_id, room_to_protos(room)[0].SerializeToString(), server.getsockname()[1])))
        while True:
            cmd, *args = conn.recv()
            if cmd == "stop":
                engine.close()
                conn.send(("ok", None))
                return
            result = None
            if cmd == "sink":
                views = [_view(addr, length) for addr, length in args[0]]
                threading.Thread(target=_socket_sink, args=(server, views), daemon=True).start()
            elif cmd == "clear":
                for addr, length in args[0]:
                    ctypes.memset(addr, 0, length)
            else:  # crc
                result = 0
                for addr, length in args[0]:
                    result = zlib.crc32(ctypes.string_at(addr, length), result)
            conn.send(("ok", result))
    except Exception as e:  # reported to the parent, which raises it
        conn.send(("error", repr(e)))


def _socket_sink(server: socket.socket, views: list[memoryview]) -> None:
    """Receive every round's entries, in plan order, straight into their pages of D's cache (the
    scatter Mooncake writes); acknowledge each round with 1 byte once all of it has landed."""
    sock, _ = server.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while all(_recv_exact(sock, view) for view in views):
        sock.sendall(b"\x01")


def _recv_exact(sock: socket.socket, view: memoryview) -> bool:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            return False
        got += n
    return True


def _socket_round(sock: socket.socket, views: list[memoryview]) -> None:
    for view in views:
        sock.sendall(view)
    if not _recv_exact(sock, memoryview(bytearray(1))):
        raise RuntimeError("socket sink closed early")


def _time_rounds(rounds: dict[str, Callable[[], object]], cfg: BenchConfig) -> tuple[dict, dict]:
    """Seconds and sender CPU seconds per round of each method. The methods alternate round by
    round, the order flipping each time, so that load from elsewhere on a shared machine and
    warm caches favour neither."""
    times: dict[str, list[float]] = {m: [] for m in rounds}
    cpu = {m: 0.0 for m in rounds}
    for i in range(cfg.warmup + cfg.repeats):
        for method in list(rounds)[:: 1 if i % 2 == 0 else -1]:
            start, cpu_start = time.perf_counter(), time.process_time()
            rounds[method]()
            if i >= cfg.warmup:
                times[method].append(time.perf_counter() - start)
                cpu[method] += time.process_time() - cpu_start
    return times, cpu


def _sender_main(conn: Any, cfg: BenchConfig) -> None:
    """P: owns the source cache; plans the room, then times Mooncake writes and socket rounds of it."""
    from common.kv.buffers import RoomBuffers
    from common.transfer.plan import build_plan
    from common.transfer.wire import room_from_protos

    try:
        cache, buf = _kv_cache(cfg, fill=True)  # named: its memory must outlive every transfer
        engine = _engine(cfg, buf.base_addr, buf.length)
        _, session_id, dst_info = conn.recv()
        dst = room_from_protos([pb.BufferInfo.FromString(dst_info)])
        plan = build_plan("bench", RoomBuffers([buf], {"kv": _room_pages(cfg, side=0)}), dst, cfg.tokens)
        crc = 0
        for e in plan.entries:
            crc = zlib.crc32(ctypes.string_at(e.src_addr, e.length), crc)
        conn.send(("ok", (len(plan.entries), len(plan.batches), plan.total_bytes, crc,
                          [(e.dst_addr, e.length) for e in plan.entries])))

        _, port = conn.recv()
        with socket.create_connection((cfg.host, port)) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            src_views = [_view(e.src_addr, e.length) for e in plan.entries]
            rounds = {"mooncake_tcp": lambda: engine.write(session_id, plan.entries),
                      "plain_tcp": lambda: _socket_round(sock, src_views)}
            conn.send(("ok", _time_rounds(rounds, cfg)))
            while (cmd := conn.recv())[0] == "once":
                rounds[cmd[1]]()
                conn.send(("ok", None))
        engine.close()
        conn.send(("ok", None))
    except Exception as e:  # reported to the parent, which raises it
        conn.send(("error", repr(e)))
