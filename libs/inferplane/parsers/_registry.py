"""Parsers chosen by name: a registry built as an immutable value, never a mutable global.

The composition root (the replica process) builds or receives a ``ParserRegistry`` and asks it for
the parser a deployment profile names (a strategy chosen by name from a registry; an unknown
name is an error listing the known ones).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from inferplane.parsers._config import EngineConfig
from inferplane.parsers._deepseek_v31 import deepseek_v31_config
from inferplane.parsers._errors import UnknownParserError
from inferplane.parsers._glm45 import glm45_config
from inferplane.parsers._gpt_oss import gpt_oss_config
from inferplane.parsers._kimi_k2 import kimi_k2_config
from inferplane.parsers._parser import Parser
from inferplane.parsers._qwen3 import qwen3_config

__all__ = ["ParserRegistry", "build_parser", "default_registry"]

ConfigFactory = Callable[[], EngineConfig]


@dataclass(frozen=True, slots=True)
class ParserRegistry:
    """Format name -> config factory.

    Attributes:
        factories: read-only mapping; build a new registry to add formats.
    """

    factories: Mapping[str, ConfigFactory]

    @property
    def names(self) -> tuple[str, ...]:
        """Known parser names, sorted."""
        return tuple(sorted(self.factories))

    def build(
        self, name: str, vocab: Mapping[str, int] | None = None, drop: Sequence[str] = ()
    ) -> Parser:
        """Compile the named parser.

        Args:
            name: a known parser name (``"kimi_k2"``, ``"qwen3"``, ...; ``names``).
            vocab: ``tokenizer.get_vocab()`` to match markers by token id, or None.
            drop: texts of tokens the response never shows besides the format's markers
                (``Parser``).

        Raises:
            UnknownParserError: ``name`` is not registered (the message lists known names).
        """
        factory = self.factories.get(name)
        if factory is None:
            raise UnknownParserError(name, self.names)
        return Parser(factory(), vocab, drop)

    def with_parser(self, name: str, factory: ConfigFactory) -> ParserRegistry:
        """A new registry that also holds ``name`` (this one is unchanged)."""
        return ParserRegistry(MappingProxyType({**self.factories, name: factory}))


def default_registry() -> ParserRegistry:
    """The formats shipped with inferplane: ``deepseek_v31``, ``glm45``, ``gpt_oss``,
    ``kimi_k2``, ``qwen3``."""
    return ParserRegistry(
        MappingProxyType(
            {
                "deepseek_v31": deepseek_v31_config,
                "glm45": glm45_config,
                "gpt_oss": gpt_oss_config,
                "kimi_k2": kimi_k2_config,
                "qwen3": qwen3_config,
            }
        )
    )


_DEFAULT = default_registry()


def build_parser(
    name: str,
    vocab: Mapping[str, int] | None = None,
    *,
    registry: ParserRegistry | None = None,
    drop: Sequence[str] = (),
) -> Parser:
    """Compile the named parser from ``registry`` (default: the shipped formats); ``drop``:
    texts of tokens the response never shows besides the format's markers (``Parser``).

    Raises:
        UnknownParserError: ``name`` is not registered.
    """
    return (registry or _DEFAULT).build(name, vocab, drop)
