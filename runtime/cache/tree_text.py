"""The radix tree as text, one node a line (`RadixCache.pretty_print`): for a terminal or a
test; the picture for people is view.py and picture.py."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from runtime.cache.radix import RadixCache, TreeNode


def tree_text(
    cache: RadixCache,
    file: TextIO | None = None,
    max_tokens: int = 10,
    max_depth: int | None = None,
    max_children: int | None = None,
    render: Callable[[tuple[int, ...]], str] | None = None,
) -> str:
    """Write the tree, one node a line: edge length, first tokens (or `render` of them),
    lock_ref; return the text. Deep or wide trees can be cut to a summary."""
    lines = []
    for namespace, root in cache.roots().items():
        lines.append(f"[namespace {namespace!r}] r={root.lock_ref}")
        stack = [(child, 1) for child in reversed(_shown(root, max_children, lines, 1))]
        while stack:
            node, level = stack.pop()
            first = node.key[:max_tokens]
            more = "..." if len(node.key) > max_tokens else ""
            head = repr(render(first)) if render else str(list(first))
            lines.append(f"{'  ' * level}len={len(node.key)} {head}{more} r={node.lock_ref}")
            if max_depth is None or level < max_depth:
                shown = _shown(node, max_children, lines, level + 1)
                stack.extend((c, level + 1) for c in reversed(shown))
            elif node.children:
                lines.append(f"{'  ' * (level + 1)}... {len(node.children)} children")
    lines.append(
        f"#tokens: {cache.total_size} (evictable {cache.evictable_size}, protected "
        f"{cache.protected_size}), #nodes: {cache.num_nodes}"
    )
    text = "\n".join(lines)
    print(text, file=file or sys.stdout)
    return text


def _shown(node: TreeNode, max_children: int | None, lines: list[str], level: int) -> list:
    """`node`'s children to show (the longest, if there are too many); says how many are not."""
    children = list(node.children.values())
    if max_children is not None and len(children) > max_children:
        lines.append(f"{'  ' * level}({len(children) - max_children} more children hidden)")
        return sorted(children, key=lambda c: -len(c.key))[:max_children]  # longest first
    return children
