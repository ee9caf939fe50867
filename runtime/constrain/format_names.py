"""Reading a format's name as a user writes it (any case, an alias): the tool-call and the
reasoning parsers are named the same way. Torch-free (flowlang imports it)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def canonical_format_name(
    name: str,
    known: Sequence[str],
    aliases: Mapping[str, str],
    unknown: type[ValueError],
    what: str,
) -> str:
    """The known name `name` stands for (case and surrounding spaces ignored, aliases
    resolved); an `unknown` error listing the names and aliases, `what` being looked up."""
    key = name.strip().lower()
    key = aliases.get(key, key)
    if key not in known:
        listed = ", ".join(f"{alias} ({target})" for alias, target in aliases.items())
        raise unknown(f"unknown {what} {name!r}; known: {', '.join(known)} (aliases: {listed})")
    return key
