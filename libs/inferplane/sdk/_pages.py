"""List results as iterators: items one by one, fetching the next page when one runs out
(AIP-158: `page_size`, `page_token`, `next_page_token`, empty on the last page)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclasses.dataclass(frozen=True, slots=True)
class Page(Generic[T]):
    """One page: its items, and the token of the next page ("" on the last one)."""

    items: tuple[T, ...]
    next_page_token: str


class Paged(Generic[T]):
    """A lazy list over pages: iterating yields every item, one request per page, each
    request with its own deadline and retries; `pages()` yields the pages themselves (to
    resume later from a `next_page_token`). Iterating twice lists twice."""

    def __init__(self, fetch: Callable[[str], Page[T]], page_token: str = "") -> None:
        self._fetch = fetch
        self._page_token = page_token

    def pages(self) -> Iterator[Page[T]]:
        token = self._page_token
        while True:
            page = self._fetch(token)
            yield page
            token = page.next_page_token
            if not token:
                return

    def __iter__(self) -> Iterator[T]:
        for page in self.pages():
            yield from page.items


class AsyncPaged(Generic[T]):
    """`Paged` for the async client: `async for item in ...`, `async for page in .pages()`."""

    def __init__(self, fetch: Callable[[str], Awaitable[Page[T]]], page_token: str = "") -> None:
        self._fetch = fetch
        self._page_token = page_token

    async def pages(self) -> AsyncIterator[Page[T]]:
        token = self._page_token
        while True:
            page = await self._fetch(token)
            yield page
            token = page.next_page_token
            if not token:
                return

    async def __aiter__(self) -> AsyncIterator[T]:
        async for page in self.pages():
            for item in page.items:
                yield item
