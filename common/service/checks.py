"""Checks of what reaches P and D over gRPC, made before anything is queued, reserved or written:
a malformed message is an InvalidRequest (INVALID_ARGUMENT) and changes nothing. The router
checks its clients' input itself; these guard the services against any other caller."""
from __future__ import annotations

import math

from common.engine.sampling import InvalidRequest, SamplingParams
from common.kv.buffers import SlotStateBuffer
from common.model.config import ModelConfig
from common.transfer.wire import ranks_from_bootstrap
from protos import pdflash_pb2 as pb

MAX_ROOM_CHARS = 128
MAX_DEADLINE_S = 24 * 3600.0  # beyond it a timer is as good as none, and huge ones overflow the loop's clock
ADDRESS_SPACE = 2**64


def check_room(room: str) -> None:
    if not room or len(room) > MAX_ROOM_CHARS:
        raise InvalidRequest(f"room must be 1 to {MAX_ROOM_CHARS} characters, got {len(room)}")


def deadline_s(requested: float, default: float) -> float:
    """The room's time budget in seconds (0: the service's default)."""
    if not (math.isfinite(requested) and 0 <= requested <= MAX_DEADLINE_S):
        raise InvalidRequest(f"deadline_s must be in [0, {MAX_DEADLINE_S:.0f}] (0: the default), got {requested}")
    return requested or default


def check_prompt(input_ids: list[int], params: SamplingParams, vocab_size: int, max_context: int) -> None:
    params.validate(len(input_ids), max_context)
    for what, ids in (("input_ids", input_ids), ("stop_token_ids", params.stop_token_ids)):
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"{what} contains token id {bad}, outside the vocabulary [0, {vocab_size})")


def check_address(addr: str, what: str) -> None:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidRequest(f"{what} must be host:port, got {addr[:100]!r}")


def check_room_request(room: str, input_ids: list[int], params: SamplingParams, peer: tuple[str, str],
                       requested_deadline_s: float, default_deadline_s: float, cfg: ModelConfig) -> float:
    """A Prefill (P) or Generate (D): `peer` is (field name, address; "" if none). Returns the
    room's seconds."""
    check_room(room)
    if peer[1]:
        check_address(peer[1], peer[0])
    check_prompt(input_ids, params, cfg.vocab_size, cfg.max_position)
    return deadline_s(requested_deadline_s, default_deadline_s)


def check_bootstrap(msg: pb.BootstrapRequest) -> None:
    """D's description of where the room's KV goes must at least describe itself consistently:
    buffers whose shape matches their length, inside the address space, every page index inside
    its buffer, and TP ranks inside the TP size. (That the pages cover the prompt is the
    transfer plan's check, once the prompt is known.)"""
    check_room(msg.room)
    check_address(msg.decode_addr, "decode_addr")
    tp_size = msg.tp_size or 1
    try:
        ranks = ranks_from_bootstrap(msg)
    except (ValueError, KeyError) as e:  # a shape that contradicts its length, an unknown kind or dtype
        raise InvalidRequest(f"bootstrap of room {msg.room}: {e}") from None
    for tp_rank, session, room in ranks:
        if tp_rank >= tp_size or not session:
            raise InvalidRequest(f"bootstrap of room {msg.room}: rank {tp_rank} of TP size {tp_size} "
                                 f"with session {session!r}")
        for buf in room.buffers:
            if buf.base_addr + buf.length > ADDRESS_SPACE:
                raise InvalidRequest(f"bootstrap of room {msg.room}: buffer {buf.name} runs past the address space")
            count = buf.num_slots if isinstance(buf, SlotStateBuffer) else buf.num_pages
            bad = next((i for i in room.indices[buf.name] if i >= count), None)
            if bad is not None:
                raise InvalidRequest(f"bootstrap of room {msg.room}: buffer {buf.name} has {count} pages, "
                                     f"index {bad} is outside it")
