"""The KV page allocator on its own: no model, no tensors."""
from __future__ import annotations

import random

import pytest

from common.kv.page_pool import OutOfPages, PagePool


def test_alloc_and_free_account_for_every_page():
    pool = PagePool(num_pages=8, page_size=4)
    assert (pool.num_free, pool.num_used) == (8, 0)
    a = pool.alloc(3)
    b = pool.alloc(5)
    assert a == [0, 1, 2]  # low indices first: a fresh request's pages are contiguous
    assert sorted(a + b) == list(range(8)) and (pool.num_free, pool.num_used) == (0, 8)
    pool.free(a)
    assert (pool.num_free, pool.num_used) == (3, 5)
    assert sorted(pool.alloc(3)) == a  # freed pages are reused
    pool.check_integrity()


def test_pages_for_rounds_up():
    pool = PagePool(10, 16)
    assert [pool.pages_for(n) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]


def test_out_of_pages_allocates_nothing():
    pool = PagePool(4, 2)
    pool.alloc(3)
    with pytest.raises(OutOfPages, match="need 2 KV pages, 1 free of 4"):
        pool.alloc(2)
    assert (pool.num_free, pool.num_used) == (1, 3)
    assert len(pool.alloc(1)) == 1 and pool.num_free == 0
    assert pool.alloc(0) == []


def test_double_free_and_foreign_pages_are_refused():
    pool = PagePool(4, 2)
    pages = pool.alloc(2)
    pool.free(pages)
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free(pages[:1])
    with pytest.raises(RuntimeError):
        pool.free([99])
    assert pool.num_free == 4
    pool.check_integrity()


def test_integrity_check_detects_corruption():
    pool = PagePool(4, 2)
    pool.alloc(2)
    pool._free.append(0)  # simulate a bug: page 0 both free and used
    with pytest.raises(RuntimeError, match="corrupted"):
        pool.check_integrity()


@pytest.mark.parametrize("num_pages, page_size", [(0, 4), (4, 0), (-1, 4)])
def test_bad_sizes(num_pages, page_size):
    with pytest.raises(ValueError):
        PagePool(num_pages, page_size)


def test_random_alloc_free_keeps_pages_unique():
    rng = random.Random(0)
    pool = PagePool(64, 4)
    held: list[list[int]] = []
    for _ in range(2000):
        if held and (rng.random() < 0.5 or pool.num_free == 0):
            pool.free(held.pop(rng.randrange(len(held))))
        else:
            held.append(pool.alloc(rng.randint(1, min(8, pool.num_free))))
        owned = [p for pages in held for p in pages]
        assert len(owned) == len(set(owned)) == pool.num_used
        assert pool.num_free + pool.num_used == 64
    pool.check_integrity()
