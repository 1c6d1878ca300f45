"""common.model.cache: a build is published whole, and processes started together build it once."""
from __future__ import annotations

import os
import threading

from common.model.cache import building, publish


def test_a_second_builder_waits_for_the_first_and_finds_its_build(tmp_path) -> None:
    final = str(tmp_path / "converted" / "model")
    builds: list[str] = []
    inside = threading.Event()

    def build_once(who: str, hold: threading.Event | None) -> None:
        with building(final):
            inside.set()
            if hold is not None:
                hold.wait(10)
            if not os.path.isdir(final):
                builds.append(who)
                assert publish(lambda tmp: open(os.path.join(tmp, "weights"), "w").close(), final)

    release = threading.Event()
    first = threading.Thread(target=build_once, args=("first", release))
    first.start()
    assert inside.wait(10)
    second = threading.Thread(target=build_once, args=("second", None))
    second.start()
    second.join(0.5)
    assert second.is_alive(), "the second builder did not wait for the first one's lock"
    release.set()
    first.join(10)
    second.join(10)
    assert builds == ["first"] and os.path.isfile(os.path.join(final, "weights"))
    assert sorted(os.listdir(tmp_path / "converted")) == [".lock", "model"]  # no per-build leftovers


def test_no_lock_where_the_cache_cannot_be_written(tmp_path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the cache's folder would be: makedirs fails
    with building(str(blocked / "sub" / "model")):
        pass
