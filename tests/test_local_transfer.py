"""Local transfer (common/transfer/local.py) without the services: a real prefill engine's KV
copied through the transfer plan into a decode engine's buffers in shared memory (a memfd,
opened the way P opens D's: through /proc/<pid>/fd), then decoded: greedy tokens equal the
single engine's. Negative controls: destinations shifted by one page decode something else, and
an entry outside D's buffers is refused before any byte moves. The services' use of it (P and
D processes, the choice of transport, the flag that turns it off) is in test_pd_equivalence.py
and test_faults.py."""
from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import uuid

import pytest
import torch

from common.engine.engine import Engine
from common.engine.request import Request
from common.engine.sampling import SamplingParams
from common.kv.buffers import RoomBuffers
from common.kv.shared import BufferMemory, host_id
from common.runner.model_runner import ModelRunner
from common.transfer.local import LocalWriter, Spans, copy_entries, open_region
from common.transfer.mooncake import TransferError
from common.transfer.plan import TransferEntry, build_plan
from common.transfer.wire import region_from_proto, region_to_proto

PAGE = 16
PROMPT = [(i * 7919) % 40000 + 100 for i in range(37)]  # 3 pages, the last part-filled
NEW = 6


@pytest.fixture(scope="module")
def engines(embedded_weights, embedded_tokenizer, embedded_runner) -> tuple[Engine, Engine]:
    """(P: prefill only, plain memory (the session's runner); D: its buffers shareable)."""
    cfg, tensors = embedded_weights
    eos = embedded_tokenizer.eos_token_ids
    assert embedded_runner.page_size == PAGE
    p = Engine(embedded_runner, eos, prefill_only=True)
    d = Engine(ModelRunner(cfg, tensors, num_pages=8, page_size=PAGE, shared_kv=True), eos)
    return p, d


@pytest.fixture(scope="module")
def reference(engines: tuple[Engine, Engine]) -> list[int]:
    req = Request(uuid.uuid4().hex, PROMPT, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    engines[1].run_all([req])
    return req.output_ids


def _pd(engines: tuple[Engine, Engine], shift_pages: int = 0) -> list[int]:
    """Prefill on P, copy by LocalWriter (destinations moved `shift_pages` pages on), decode on D."""
    p, d = engines
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    sent, got = Request(uuid.uuid4().hex, PROMPT, params), Request(uuid.uuid4().hex, PROMPT, params)
    p.add(sent)
    while not sent.output_ids:
        p.step()
    d.reserve(got)
    try:
        plan = build_plan(sent.rid, RoomBuffers(p.describe_buffers(), p.room_pages(sent)),
                          RoomBuffers(d.describe_buffers(), d.room_pages(got)), len(PROMPT))
        page_bytes = d.describe_buffers()[0].bytes_per_page
        entries = [dataclasses.replace(e, dst_addr=e.dst_addr + shift_pages * page_bytes) for e in plan.entries]
        writer = LocalWriter(p.runner.memory, p.runner.device)
        assert writer.open("d", d.runner.memory.regions)
        assert writer.write("d", entries) == plan.total_bytes
        got.cache.length = len(PROMPT)
        d.add_prefilled(got, sent.output_ids[0])
        d.run_all()
        return got.output_ids
    finally:
        p.release(sent)
        d.release(got)


def test_local_copy_equals_single_engine(engines, reference) -> None:
    assert _pd(engines) == reference
    # The memory D offers is a memfd of this process, opened through /proc like any other.
    (kv,) = engines[1].runner.memory.regions
    assert kv.pid == os.getpid() and kv.base_addr == engines[1].runner.kv.data_ptr()
    assert engines[0].runner.memory.regions == []  # P's memory is plain: it offers nothing


def test_negative_control_destination_one_page_off_decodes_otherwise(engines, reference) -> None:
    assert _pd(engines, shift_pages=1) != reference


def test_entry_outside_the_opened_buffer_moves_nothing(engines) -> None:
    p, d = engines
    (region,) = d.runner.memory.regions
    src = Spans.of([(t.data_ptr(), t.numel() * t.element_size(), t.view(-1).view(torch.uint8))
                     for t in p.runner.memory.tensors])
    dst = Spans.of([(region.base_addr, region.length, open_region(region, torch.device("cpu")))])
    p_base = p.runner.kv.data_ptr()
    before = d.runner.kv.clone()
    inside = TransferEntry(p_base, region.base_addr, 4096)
    past_end = TransferEntry(p_base, region.base_addr + region.length - 64, 128)
    with pytest.raises(TransferError, match="destination entry .* not inside any buffer"):
        copy_entries([inside, past_end], src, dst)
    assert torch.equal(d.runner.kv, before)  # not even the entry that was inside


def test_small_entries_gather_and_large_ones_slice_alike() -> None:
    """Both ways of copying a run (a batched gather/scatter of rows, one slice per entry) put the
    same bytes in the same places, whatever the offsets' alignment."""
    memory = BufferMemory(shareable=True)
    src = torch.arange(1 << 20, dtype=torch.int32).view(torch.uint8)
    dst = memory.zeros((1 << 22,), torch.uint8, torch.device("cpu"))
    region = memory.regions[0]
    spans = (Spans.of([(src.data_ptr(), src.numel(), src)]),
             Spans.of([(region.base_addr, region.length, open_region(region, torch.device("cpu")))]))
    for size, stride in ((6, 10), (96, 160), (1 << 17, (1 << 17) + 512)):  # gathered, gathered, sliced
        dst.zero_()
        entries = [TransferEntry(src.data_ptr() + 2 * i * size, region.base_addr + i * stride, size)
                   for i in range(7)]
        assert copy_entries(entries, *spans) == 7 * size
        for i in range(7):
            assert torch.equal(dst[i * stride:i * stride + size], src[2 * i * size:(2 * i + 1) * size])
        assert int(dst.count_nonzero()) <= 7 * size  # nothing written between the entries


def test_a_region_that_is_not_ours_does_not_open(engines) -> None:
    """P maps only the memory file D named (its random name is checked on the descriptor), so a
    Bootstrap naming any other descriptor (here our stdin, or D's file under another name) fails
    to open, and the writer falls back to Mooncake for that D. A D rank on another host (its
    regions' host id) is not even tried: its pid and descriptor name nothing here."""
    (region,) = engines[1].runner.memory.regions
    for bad in (dataclasses.replace(region, fd=0), dataclasses.replace(region, name="pdflash-" + "0" * 16),
                dataclasses.replace(region, name="../../etc/passwd")):
        with pytest.raises((TransferError, OSError)):
            open_region(bad, torch.device("cpu"))
    writer = LocalWriter(engines[0].runner.memory, torch.device("cpu"))
    assert not writer.open("d", [dataclasses.replace(region, fd=0)])
    assert writer.open("d", [region])  # the real one replaces the refused one
    assert region.host == host_id() and host_id()  # Linux: the boot id and host name P and D compare
    assert not writer.open("elsewhere", [dataclasses.replace(region, host="another-boot-id/another-host")])
    assert "elsewhere" not in writer._open and "elsewhere" not in writer._refused
    assert region_from_proto(region_to_proto(region)) == region  # its host too, as Bootstrap carries it


def _decode_process(conn) -> None:
    """A D: a shareable buffer, its region sent to the parent; checks what landed in it."""
    memory = BufferMemory(shareable=True)
    buf = memory.zeros((4096,), torch.uint8, torch.device("cpu"))
    conn.send(memory.regions[0])
    offset, expected = conn.recv()
    conn.send(bool(torch.equal(buf[offset:offset + len(expected)], expected)) and int(buf.count_nonzero()))
    conn.recv()  # until told to exit


def test_copy_into_another_process_which_is_let_go_once_dead() -> None:
    cpu = torch.device("cpu")
    ours, theirs = mp.get_context("fork").Pipe()
    child = mp.get_context("fork").Process(target=_decode_process, args=(theirs,), daemon=True)
    child.start()
    try:
        region = ours.recv()
        memory = BufferMemory()
        src = memory.zeros((4096,), torch.uint8, cpu)
        src.copy_(torch.arange(1, 4097) % 251 + 1)  # no zero byte
        writer = LocalWriter(memory, cpu)
        assert writer.open("d", [region])
        assert writer.write("d", [TransferEntry(src.data_ptr() + 100, region.base_addr + 1000, 500)]) == 500
        ours.send((1000, src[100:600].clone()))
        assert ours.recv() == 500  # those bytes, there, and nothing else
        ours.send("exit")
    finally:
        child.join(30)
    # The next D opened here drops the dead one's mapping (its memory would live on otherwise).
    other = BufferMemory(shareable=True)
    other.zeros((64,), torch.uint8, cpu)
    assert writer.open("d2", other.regions)
    assert "d" not in writer._open and "d2" in writer._open
