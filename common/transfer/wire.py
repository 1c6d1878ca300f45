"""Convert between `common.kv.buffers` descriptions and `protos.BufferInfo` (sent in Bootstrap)."""
from __future__ import annotations

from collections.abc import Iterable

from common.kv.buffers import PagedKVBuffer, RankEndpoint, RoomBuffers, SlotStateBuffer
from common.kv.shared import CudaIpcHandle, SharedRegion
from protos import pdflash_pb2 as pb

PAGED_KV = "paged_kv"
SLOT_STATE = "slot_state"


def buffer_to_proto(buf: PagedKVBuffer | SlotStateBuffer, indices: Iterable[int] = ()) -> pb.BufferInfo:
    if isinstance(buf, PagedKVBuffer):
        return pb.BufferInfo(
            name=buf.name, kind=PAGED_KV, base_addr=buf.base_addr, length=buf.length,
            num_layers=buf.num_layers, num_pages=buf.num_pages, page_size=buf.page_size,
            num_heads=buf.num_heads, head_start=buf.head_start, total_heads=buf.total_heads,
            head_dim=buf.head_dim, dtype=buf.dtype, layout=buf.layout,
            bytes_per_page=buf.bytes_per_page, indices=list(indices),
            layer_start=buf.layer_start, total_layers=buf.total_layers,
        )
    return pb.BufferInfo(
        name=buf.name, kind=SLOT_STATE, base_addr=buf.base_addr, length=buf.length,
        num_layers=buf.num_layers, num_pages=buf.num_slots, bytes_per_page=buf.bytes_per_slot,
        dtype=buf.dtype, indices=list(indices), parts=buf.parts, num_heads=buf.num_heads,
        head_start=buf.head_start, total_heads=buf.total_heads, layer_start=buf.layer_start,
        total_layers=buf.total_layers,
    )


def buffer_from_proto(info: pb.BufferInfo) -> tuple[PagedKVBuffer | SlotStateBuffer, list[int]]:
    indices = list(info.indices)
    if info.kind == SLOT_STATE:
        buf = SlotStateBuffer(
            name=info.name, base_addr=info.base_addr, num_layers=info.num_layers,
            num_slots=info.num_pages, bytes_per_slot=info.bytes_per_page, dtype=info.dtype,
            parts=info.parts or 1, num_heads=info.num_heads or 1, head_start=info.head_start,
            total_heads=info.total_heads or 1, layer_start=info.layer_start, total_layers=info.total_layers,
        )
    elif info.kind == PAGED_KV:
        buf = PagedKVBuffer(
            name=info.name, base_addr=info.base_addr, num_layers=info.num_layers,
            num_pages=info.num_pages, page_size=info.page_size, num_heads=info.num_heads,
            head_start=info.head_start, total_heads=info.total_heads, head_dim=info.head_dim,
            dtype=info.dtype, kv_planes=_kv_planes(info), layout=info.layout,
            layer_start=info.layer_start, total_layers=info.total_layers,
        )
        if buf.bytes_per_page != info.bytes_per_page:
            raise ValueError(
                f"buffer {info.name}: bytes_per_page {info.bytes_per_page} does not match its shape "
                f"({buf.bytes_per_page} = page_size x heads x head_dim x {info.dtype})"
            )
    else:
        raise ValueError(f"buffer {info.name}: unknown kind {info.kind!r}")
    if buf.length != info.length:
        raise ValueError(f"buffer {info.name}: length {info.length} does not match its shape ({buf.length})")
    return buf, indices


def room_to_protos(room: RoomBuffers) -> list[pb.BufferInfo]:
    return [buffer_to_proto(b, room.indices.get(b.name, ())) for b in room.buffers]


def room_from_protos(infos: Iterable[pb.BufferInfo]) -> RoomBuffers:
    room = RoomBuffers(buffers=[])
    for info in infos:
        buf, indices = buffer_from_proto(info)
        room.buffers.append(buf)
        room.indices[buf.name] = indices
    return room


def _kv_planes(info: pb.BufferInfo) -> int:
    # BufferInfo has no kv_planes field: K+V (2) or latent (1) follows from the registered length.
    per_plane = info.num_layers * info.num_pages * info.bytes_per_page
    if per_plane == 0 or info.length % per_plane or info.length // per_plane not in (1, 2):
        raise ValueError(
            f"buffer {info.name}: length {info.length} is not 1 or 2 planes of "
            f"{info.num_layers} layers x {info.num_pages} pages x {info.bytes_per_page} bytes"
        )
    return info.length // per_plane


def ranks_to_protos(ranks: list[RankEndpoint], indices: dict[str, list[int]]) -> list[pb.RankBuffers]:
    """Every rank of an instance with a room's pages (the page tables are the same on every rank)."""
    return [pb.RankBuffers(tp_rank=r.tp_rank, session_id=r.session_id,
                           buffers=room_to_protos(RoomBuffers(r.buffers, indices)),
                           shared=[region_to_proto(s) for s in r.shared]) for r in ranks]


def ranks_from_bootstrap(msg: pb.BootstrapRequest) -> list[tuple[int, str, RoomBuffers]]:
    """(tp rank, Mooncake session, room buffers) of each D rank; a D of one rank may send only
    the single-rank fields."""
    if not msg.ranks:
        return [(msg.tp_rank, msg.session_id, room_from_protos(msg.buffers))]
    return [(r.tp_rank, r.session_id, room_from_protos(r.buffers)) for r in msg.ranks]


def shared_from_bootstrap(msg: pb.BootstrapRequest) -> dict[str, list[SharedRegion]]:
    """Mooncake session -> that D rank's buffers as a process on D's host opens them, for the
    ranks that offer them."""
    return {r.session_id: [region_from_proto(s) for s in r.shared] for r in msg.ranks if r.shared}


def region_to_proto(region: SharedRegion) -> pb.SharedRegion:
    msg = pb.SharedRegion(base_addr=region.base_addr, length=region.length, pid=region.pid, fd=region.fd,
                          name=region.name, host_id=region.host)
    if region.cuda is not None:
        c = region.cuda
        msg.cuda.CopyFrom(pb.CudaIpcHandle(
            handle=c.handle, storage_size=c.storage_size, storage_offset=c.storage_offset,
            ref_counter_handle=c.ref_counter_handle, ref_counter_offset=c.ref_counter_offset,
            event_handle=c.event_handle, event_sync_required=c.event_sync_required))
    return msg


def region_from_proto(msg: pb.SharedRegion) -> SharedRegion:
    cuda = None
    if msg.HasField("cuda"):
        c = msg.cuda
        cuda = CudaIpcHandle(c.handle, c.storage_size, c.storage_offset, c.ref_counter_handle, c.ref_counter_offset,
                             c.event_handle, c.event_sync_required)
    return SharedRegion(msg.base_addr, msg.length, msg.pid, msg.fd, msg.name, cuda, msg.host_id)
