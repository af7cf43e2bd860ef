"""The harness's one page allocator: a free list over a cache's page ids, used by the serving
loop (`engine.Engine.run`) and by `synthetic.Harness`, so that block tables are built one way."""

from __future__ import annotations

from collections import deque
from typing import Iterable

from ..validate import as_int


class PoolTooSmallError(ValueError):
    """A request needs more pages than the whole cache holds."""


class PageAllocator:
    """A free list over page ids [0, num_pages).

    order: the free list's first order, a permutation of range(num_pages) (default ascending);
    pages are handed out from its front and freed pages go to its back. A shuffled order gives
    block tables that are not contiguous (synthetic.Harness: the kernels must not depend on it).
    """

    def __init__(self, num_pages: int, *, order: Iterable[int] | None = None):
        self.num_pages = as_int(num_pages, "num_pages", 1)
        if order is None:
            order = range(self.num_pages)
        else:
            order = [int(p) for p in order]
            if sorted(order) != list(range(self.num_pages)):
                raise ValueError(f"order must be a permutation of range(num_pages) = range({self.num_pages})")
        self._free = deque(order)
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """n page ids, or None when fewer than n are free (PoolTooSmallError if n > num_pages)."""
        if n > self.num_pages:
            raise PoolTooSmallError(f"a request needs {n} pages but the cache has only {self.num_pages} "
                                    "(raise num_pages or shorten the requests)")
        if n > len(self._free):
            return None
        pages = [self._free.popleft() for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Returns allocated pages to the free list (ValueError naming a page that was not allocated)."""
        for p in pages:
            if p not in self._used:
                raise ValueError(f"page {p} is freed but was not allocated")
            self._used.remove(p)
            self._free.append(p)
