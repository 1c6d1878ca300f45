"""common/kv_checksum.py (P's and D's CRC32 per (buffer, layer, k/v, page)) and D's check of them
(KVReceiver._verify): equal KV in different pages on the two sides gives equal lists, one flipped
byte anywhere in a used token changes exactly one checksum, bytes past the prompt don't count."""
from __future__ import annotations

import asyncio
import zlib
from types import SimpleNamespace

import grpc
import pytest
import torch

from common.engine.request import Request
from common.engine.sampling import SamplingParams
from common.kv.checksum import page_checksums, room_checksums
from decode_svc.kv_receiver import HandoffError, KVReceiver

LAYERS, PAGES, PAGE, HEADS, DIM = 3, 10, 4, 2, 8


def kv(dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYERS, 2, PAGES, PAGE, HEADS, DIM, generator=g).to(dtype)


def copy_room(src: torch.Tensor, src_pages: list[int], dst: torch.Tensor, dst_pages: list[int]) -> None:
    for s, d in zip(src_pages, dst_pages):
        dst[:, :, d] = src[:, :, s]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 4, 5, 11, 12])
def test_same_tokens_in_other_pages_give_the_same_checksums(dtype: torch.dtype, num_tokens: int) -> None:
    p, d = kv(dtype, 1), kv(dtype, 2)
    p_pages, d_pages = [7, 2, 5], [0, 9, 3]
    copy_room(p, p_pages, d, d_pages)
    sent = page_checksums(p, p_pages, num_tokens)
    assert len(sent) == LAYERS * 2 * -(-num_tokens // PAGE)
    assert page_checksums(d, d_pages, num_tokens) == sent
    assert page_checksums(kv(dtype, 3), p_pages, num_tokens) != sent


def test_order_is_page_then_layer_then_k_v() -> None:
    t = kv()
    sums = page_checksums(t, [4, 1], 6)  # 4 tokens in page 4, 2 in page 1
    want = [zlib.crc32(t[l, k, 4].numpy().tobytes()) for l in range(LAYERS) for k in range(2)]
    want += [zlib.crc32(t[l, k, 1, :2].numpy().tobytes()) for l in range(LAYERS) for k in range(2)]
    assert sums == want


def test_each_flipped_byte_changes_exactly_its_checksum() -> None:
    t, pages, n = kv(), [3, 8, 6], 10
    sent = page_checksums(t, pages, n)
    raw = t.view(torch.uint8)  # [layer, k/v, page, token, head, dim * 4]
    for layer, plane, i, token, byte in [(0, 0, 0, 0, 0), (2, 1, 1, 3, 31), (1, 0, 2, 1, 17), (2, 1, 2, 0, 5)]:
        bad = t.clone()
        bad.view(torch.uint8)[layer, plane, pages[i], token, 1, byte] ^= 0x40
        got = page_checksums(bad, pages, n)
        diff = [j for j, (a, b) in enumerate(zip(got, sent)) if a != b]
        assert diff == [i * LAYERS * 2 + layer * 2 + plane]
    assert raw.shape[-1] == DIM * 4


def test_bytes_past_the_prompt_and_other_pages_do_not_count() -> None:
    t, pages, n = kv(), [3, 8, 6], 9  # page 6 holds 1 token of the prompt
    sent = page_checksums(t, pages, n)
    other = t.clone()
    other[:, :, 6, 1:] = 0  # unused slots of the last page
    other[:, :, 0] = 0  # a page the room doesn't own
    assert page_checksums(other, pages, n) == sent
    assert page_checksums(t, pages + [0, 1], n) == sent  # reserved pages past the prompt


def test_room_checksums_walks_buffers_in_name_order() -> None:
    a, b = kv(seed=1), kv(seed=2)[:1]
    room = room_checksums({"kv": a, "draft_kv": b}, {"kv": [1, 2], "draft_kv": [5]}, 4)
    assert room == page_checksums(b, [5], 4) + page_checksums(a, [1, 2], 4)


def _receiver(tensor: torch.Tensor, pages: list[int]) -> tuple[KVReceiver, Request]:
    engine = SimpleNamespace(room_checksums=lambda req: room_checksums({"kv": tensor}, {"kv": list(req.cache.pages)},
                                                                      req.prompt_len))
    req = Request("room", list(range(7)), SamplingParams(max_new_tokens=1))
    req.cache.pages = pages
    return KVReceiver(SimpleNamespace(engine=engine, on_out_of_service=lambda fail: None), "127.0.0.1:1", "127.0.0.1:2"), req


def test_decode_accepts_matching_pages_and_counts_them() -> None:
    p, d = kv(seed=1), kv(seed=2)
    copy_room(p, [0, 1], d, [5, 9])
    receiver, req = _receiver(d, [5, 9])
    asyncio.run(receiver._verify(req, page_checksums(p, [0, 1], 7)))
    assert req.verified_pages == LAYERS * 2 * 2


@pytest.mark.parametrize("tamper", ["byte", "missing", "extra"])
def test_decode_fails_the_room_with_data_loss(tamper: str) -> None:
    p, d = kv(seed=1), kv(seed=2)
    copy_room(p, [0, 1], d, [5, 9])
    expected = page_checksums(p, [0, 1], 7)
    if tamper == "byte":
        d.view(torch.uint8)[1, 1, 9, 2, 0, 0] ^= 1
    elif tamper == "missing":
        expected = expected[:-1]
    else:
        expected = expected + [0]
    receiver, req = _receiver(d, [5, 9])
    with pytest.raises(HandoffError) as info:
        asyncio.run(receiver._verify(req, expected))
    assert info.value.code == grpc.StatusCode.DATA_LOSS and "checksums differ" in str(info.value)
    assert req.verified_pages == 0
