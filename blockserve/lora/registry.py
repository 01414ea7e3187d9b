"""`AdapterRegistry`: the adapters an engine serves, by name, the one record that the input
check, /v1/models, the load and unload routes and the runner all read (torch-free)."""

from __future__ import annotations

import threading
from collections.abc import ItemsView, Iterator, Mapping


class AdapterRegistry(Mapping[str, str]):
    """Adapter name -> the path it was loaded from, in load order.

    Read on the tokenizer threads (a request's adapter checked), on the event loop (/v1/models,
    a request's `model`) and on the engine thread (the runner); changed on the engine thread
    alone (a load or an unload between steps). A lock makes each read and each change whole:
    iterating reads a copy taken at once.
    """

    def __init__(self, adapters: Mapping[str, str] | None = None) -> None:
        self._lock = threading.Lock()
        self._paths: dict[str, str] = dict(adapters or {})

    def __getitem__(self, name: str) -> str:
        with self._lock:
            return self._paths[name]

    def __iter__(self) -> Iterator[str]:
        with self._lock:
            names = list(self._paths)
        return iter(names)

    def __len__(self) -> int:
        with self._lock:
            return len(self._paths)

    def items(self) -> ItemsView[str, str]:
        """Every (name, path), as one moment saw them."""
        with self._lock:
            return dict(self._paths).items()

    def add(self, name: str, path: str) -> None:
        with self._lock:
            self._paths[name] = path

    def remove(self, name: str) -> bool:
        """Forget `name`; whether it was served."""
        with self._lock:
            return self._paths.pop(name, None) is not None
