"""The adapter registry: one record read on several threads while the engine's thread changes
it; every read whole."""

from __future__ import annotations

import threading

from blockserve.lora.registry import AdapterRegistry


def test_loads_and_unloads_show_to_every_reader() -> None:
    registry = AdapterRegistry({"a": "/adapters/a"})
    registry.add("b", "/adapters/b")
    assert (dict(registry), "b" in registry, len(registry)) == (
        {"a": "/adapters/a", "b": "/adapters/b"},
        True,
        2,
    )
    assert registry.remove("a") is True
    assert registry.remove("a") is False
    assert (list(registry.items()), registry.get("a")) == ([("b", "/adapters/b")], None)


def test_items_read_while_another_thread_loads_and_unloads_are_whole() -> None:
    """A reader listing (name, path) pairs while names come and go never fails and never sees
    a name without its path: items() is one moment's copy."""
    registry = AdapterRegistry()
    stop = threading.Event()

    def churn() -> None:
        for i in range(20_000):
            registry.add(f"n{i % 7}", f"/p/{i % 7}")
            registry.remove(f"n{(i + 3) % 7}")
        stop.set()

    writer = threading.Thread(target=churn)
    writer.start()
    seen = 0
    for reads in range(200_000):  # at least 1,000 reads, then until the writer is done
        for name, path in registry.items():
            assert path == f"/p/{name[1:]}"
            seen += 1
        if reads >= 1_000 and stop.is_set():
            break
    writer.join()
    assert seen > 0
