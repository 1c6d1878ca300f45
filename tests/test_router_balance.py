"""Which instance the router gives a room: the one in service with the fewest of its rooms in flight,
round robin among equals (router_svc/instances.py says why not plain round robin). Picks only
(no process, no RPC): an instance is its address here; tests/test_router_instances.py routes real
requests over real replicas."""
from __future__ import annotations

import pytest

from common.engine.sampling import InvalidRequest
from router_svc.backend import Backend, BackendHealth
from router_svc.dispatch import Dispatcher
from router_svc.errors import ApiError
from router_svc.instances import Instances
from protos import pdflash_pb2 as pb


def backends(role: str, n: int) -> list[Backend]:
    return [Backend(role, f"{role}-{i}:1", channel=None, stub=None) for i in range(n)]


def addrs(picked: list[Backend]) -> list[str]:
    return [b.addr.split(":")[0] for b in picked]


def test_idle_instances_take_turns() -> None:
    role = Instances("prefill", backends("prefill", 3))
    picked = []
    for _ in range(6):
        picked.append(role.pick())
        role.done(picked[-1])
    assert addrs(picked) == ["prefill-0", "prefill-1", "prefill-2"] * 2


def test_a_slow_instance_gets_no_more_rooms_until_the_others_are_as_busy() -> None:
    """Round robin kept giving an instance whose rooms stayed in flight half of the new ones; now
    its peer takes them until both are as busy."""
    role = Instances("prefill", backends("prefill", 2))
    slow = [role.pick()]  # prefill-0: its rooms never end here
    for _ in range(5):
        fast = role.pick()
        assert fast.addr.startswith("prefill-1")
        role.done(fast)
    slow += [role.pick(), role.pick()]  # prefill-1 has none in flight: both to it, then to the equal one
    assert addrs(slow) == ["prefill-0", "prefill-1", "prefill-0"]
    assert role.rooms == {"prefill-0:1": 2, "prefill-1:1": 1}
    for b in slow:
        role.done(b)
    assert role.rooms == {"prefill-0:1": 0, "prefill-1:1": 0}


def test_an_instance_out_of_service_is_skipped_however_idle() -> None:
    role = Instances("decode", backends("decode", 2))
    busy = role.pick()  # decode-0, left in flight
    role.update(BackendHealth("decode", "decode-1:1", pb.HealthReply(ok=False), "node lost"))
    assert role.pick() is busy
    role.update(BackendHealth("decode", "decode-0:1", None, "no answer"))
    with pytest.raises(ApiError) as e:
        role.pick()
    assert e.value.status == 503 and "decode-1:1: node lost" in e.value.message
    role.update(BackendHealth("decode", "decode-1:1", pb.HealthReply(ok=True)))
    assert addrs([role.pick()]) == ["decode-1"]


def test_a_slow_decode_instance_does_not_keep_failing_one_prefill_instances_rooms() -> None:
    """Plain round robin over 2 P and 2 D paired P i with D i for good, so a slow D i took every
    room of P i. Here decode-0 is slow (its rooms stay); after the first, P 0's rooms go elsewhere."""
    dispatcher = Dispatcher(backends("prefill", 2), backends("decode", 2), timeout_s=60, transfer_deadline_s=30)
    prefills, decodes = dispatcher._roles
    pairs = []
    for _ in range(6):
        route = dispatcher.route()
        prefills.done(route.prefill)  # the hand-off is over
        if route.decode.addr.startswith("decode-1"):
            decodes.done(route.decode)
        pairs.append((route.prefill.addr[:9], route.decode.addr[:8]))
    assert pairs == [("prefill-0", "decode-0"), ("prefill-1", "decode-1")] + [
        ("prefill-0", "decode-1"), ("prefill-1", "decode-1")] * 2
    assert decodes.rooms == {"decode-0:1": 1, "decode-1:1": 0}


def test_a_refused_route_counts_nothing() -> None:
    dispatcher = Dispatcher(backends("prefill", 1), backends("decode", 1), timeout_s=60, transfer_deadline_s=30)
    prefills, decodes = dispatcher._roles
    prefills.update(BackendHealth("prefill", "prefill-0:1", None, "down"))
    with pytest.raises(ApiError):
        dispatcher.route()
    assert decodes.rooms == {"decode-0:1": 0}


def test_a_route_header_pins_its_instances_only_when_allowed() -> None:
    """X-PDflash-Route (tests and debugging) names a P and a D by index; a role it leaves out is
    balanced as usual. Refused (a 400, before dispatch) unless the router allows it, or malformed."""
    dispatcher = Dispatcher(backends("prefill", 3), backends("decode", 2), timeout_s=60, transfer_deadline_s=30,
                            allow_pins=True)
    prefills, decodes = dispatcher._roles
    assert dispatcher.pin(None) is None
    route = dispatcher.route(dispatcher.pin("p=2, d=1"))
    assert addrs([route.prefill, route.decode]) == ["prefill-2", "decode-1"]
    assert addrs([dispatcher.route(dispatcher.pin("d=1")).decode]) == ["decode-1"]  # P balanced: prefill-0
    assert prefills.rooms == {"prefill-0:1": 1, "prefill-1:1": 0, "prefill-2:1": 1}
    assert decodes.rooms == {"decode-0:1": 0, "decode-1:1": 2}
    for bad in ("p=3", "d=-1", "p=1,p=2", "x=0", "p=1;d=0", "p=", "", "d=\u00b2"):
        with pytest.raises(InvalidRequest, match="X-PDflash-Route"):
            dispatcher.pin(bad)
    decodes.update(BackendHealth("decode", "decode-0:1", None, "node lost"))
    with pytest.raises(ApiError) as e:  # a pinned instance out of service is not swapped for another
        dispatcher.route(dispatcher.pin("d=0"))
    assert e.value.status == 503 and "decode-0:1 is not in service (node lost)" in e.value.message
    closed = Dispatcher(backends("prefill", 1), backends("decode", 1), timeout_s=60, transfer_deadline_s=30)
    with pytest.raises(InvalidRequest, match="--allow-route-header"):
        closed.pin("p=0,d=0")
