"""The radix tree drawn as SVG: root on the left, one column per tree level, one row per leaf.

Box width grows with the edge's tokens (square root, so a 2,000-token system prompt and a
48-token reply both stay readable); colour says who holds a node: pinned (a fork's or a batch's
shared prefix), locked (a running request), or evictable. Eviction candidates carry their rank
in eviction order, and nodes the graph policy knows a next use of say which. What a summarised
view leaves out is drawn as one dashed box per parent ("+12 nodes, 3,400 tokens").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from runtime.cache.view import CacheView, NodeView
from runtime.svg import Svg, fit, legend, text_width

COLUMN_PX = 200
BOX_MIN_PX, BOX_MAX_PX = 72, 180
BOX_H_PX = 22
ROW_PX = 54  # a box, its label line and its badge line
TOP_PX = 62  # the header and the legend
NAMESPACE_GAP_PX = 30
COLOURS = {  # state -> (fill, stroke)
    "pinned": ("#c9b3f0", "#6a3fb5"),
    "locked": ("#f7c98b", "#c2731a"),
    "evictable": ("#cfe8cf", "#4c8a4c"),
    "hidden": ("#f2f2f2", "#999999"),
}


@dataclass
class _Placed:
    node: NodeView | None  # None: a summary of hidden nodes
    level: int
    y_px: float
    children: list[_Placed]
    hidden: tuple[int, int] = (0, 0)  # (nodes, tokens) for a summary box


def cache_svg(view: CacheView, width_px: int = 960) -> str:
    """The view as an SVG document (a string)."""
    trees, y_px = [], float(TOP_PX)
    namespaces = [ns for ns in view.namespaces if ns.children or ns.hidden_nodes]
    namespaces = namespaces or list(view.namespaces[:1])
    for namespace in namespaces:
        y_px += NAMESPACE_GAP_PX if len(namespaces) > 1 else 0
        rows = _Rows(y_px)
        placed = [rows.place(child, 0) for child in namespace.children]
        if namespace.hidden_nodes:
            placed.append(rows.summary(0, namespace.hidden_nodes, namespace.hidden_tokens))
        heading = f"namespace {namespace.namespace}"
        if namespace.replica is not None:
            heading = f"replica {namespace.replica} \u00b7 {heading}"
        trees.append((heading, y_px, placed))
        y_px = rows.next_y_px + 8
    depth = max((p.level for _, _, tree in trees for p in _walk(tree)), default=0) + 1
    largest = max((n.num_tokens for n in view.nodes()), default=1)
    svg = Svg(max(width_px, 40 + depth * COLUMN_PX), max(y_px, TOP_PX + 40), "radix tree")
    _header(svg, view)
    for heading, top_px, placed in trees:
        if len(namespaces) > 1:
            svg.text(12, top_px - 8, heading, 12, font_weight="bold", class_="namespace")
        for p in _walk(placed):
            _draw(svg, p, largest)
    if not view.num_shown:
        svg.text(20, TOP_PX + 24, "(the tree is empty)", 13, fill="#666")
    return str(svg)


class _Rows:
    """Assigns each leaf the next row; a parent sits halfway between its first and last child."""

    def __init__(self, top_px: float) -> None:
        self.next_y_px = top_px

    def place(self, node: NodeView, level: int) -> _Placed:
        children = [self.place(c, level + 1) for c in node.children]
        if node.hidden_nodes:
            children.append(self.summary(level + 1, node.hidden_nodes, node.hidden_tokens))
        if children:
            y_px = (children[0].y_px + children[-1].y_px) / 2
        else:
            y_px = self._take()
        return _Placed(node, level, y_px, children)

    def summary(self, level: int, nodes: int, tokens: int) -> _Placed:
        return _Placed(None, level, self._take(), [], (nodes, tokens))

    def _take(self) -> float:
        y_px = self.next_y_px
        self.next_y_px += ROW_PX
        return y_px


def _walk(placed: list[_Placed]):
    stack = list(placed)
    while stack:
        p = stack.pop()
        yield p
        stack.extend(p.children)


def _box_width(num_tokens: int, largest: int) -> float:
    share = math.sqrt(num_tokens / max(largest, 1))
    return BOX_MIN_PX + (BOX_MAX_PX - BOX_MIN_PX) * min(1.0, share)


def _draw(svg: Svg, p: _Placed, largest: int) -> None:
    x_px = 16 + p.level * COLUMN_PX
    if p.node is None:
        nodes, tokens = p.hidden
        fill, stroke = COLOURS["hidden"]
        svg.rect(
            x_px, p.y_px, BOX_MAX_PX * 0.8, BOX_H_PX,
            fill=fill, stroke=stroke, stroke_dasharray="4 3", rx=4, class_="hidden",
        )  # fmt: skip
        svg.text(
            x_px + 6,
            p.y_px + 15,
            f"+{nodes:,} node{'s' * (nodes != 1)}, {tokens:,} tok",
            11,
            fill="#555",
        )
        return
    node = p.node
    width_px = _box_width(node.num_tokens, largest)
    _edges(svg, p, x_px + width_px)
    fill, stroke = COLOURS[node.state]
    svg.open_group(class_=f"node {node.state}")
    svg.rect(
        x_px, p.y_px, width_px, BOX_H_PX,
        fill=fill, stroke=stroke, rx=4, stroke_width=2 if node.num_pins else 1,
    )  # fmt: skip
    size = f"{node.num_tokens:,} tok" + (f" \u00b7 r={node.lock_ref}" if node.lock_ref else "")
    svg.text(x_px + 5, p.y_px + 15, fit(size, width_px - 8, 11), 11, class_="tokens")
    label = fit(node.label, COLUMN_PX - 14, 10)
    svg.text(x_px, p.y_px + BOX_H_PX + 13, label, 10, fill="#444", class_="label")
    for bx, colour, text in _badges(node, x_px):
        svg.text(bx, p.y_px + BOX_H_PX + 26, text, 10, fill=colour, class_="badge")
    svg.close_group()


def _edges(svg: Svg, p: _Placed, right_px: float) -> None:
    """Curves from the right end of `p`'s box to each child's left end (under the boxes)."""
    sy = p.y_px + BOX_H_PX / 2
    for child in p.children:
        cx, cy = 16 + child.level * COLUMN_PX, child.y_px + BOX_H_PX / 2
        mid = (right_px + cx) / 2
        curve = f"M{right_px:.1f},{sy:.1f} C{mid:.1f},{sy:.1f} {mid:.1f},{cy:.1f} {cx:.1f},{cy:.1f}"
        svg.path(curve, fill="none", stroke="#888", stroke_width=1.2)


def _badges(node: NodeView, x_px: float) -> list[tuple[float, str, str]]:
    """(x, colour, text) of the notes under a node: pins, eviction rank, known next use."""
    notes = []
    if node.num_pins:
        notes.append(("#6a3fb5", f"pinned \u00d7{node.num_pins}"))
    if node.evict_rank is not None:
        notes.append(("#b22222", f"evict #{node.evict_rank}"))
    if node.next_use is not None:
        notes.append(("#1f5fa8", f"next: {node.next_use}"))
    placed = []
    for colour, text in notes:
        placed.append((x_px, colour, text))
        x_px += text_width(text, 10) + 8
    return placed


def _header(svg: Svg, view: CacheView) -> None:
    used = view.total_tokens / max(view.capacity_tokens, 1)
    shown = view.num_shown
    summary = (
        f"radix tree: {view.total_tokens:,} tokens cached of {view.capacity_tokens:,} slots "
        f"({used:.0%}) \u00b7 evictable {view.evictable_tokens:,} \u00b7 protected "
        f"{view.protected_tokens:,} \u00b7 {view.num_nodes:,} nodes"
        + (f" ({shown} shown)" if shown < view.num_nodes else "")
        + f" \u00b7 {len(view.pins)} pins \u00b7 eviction {view.policy}"
        + (
            f" \u00b7 below: host {view.host_tokens:,}, disk {view.disk_tokens:,} tokens"
            if view.host_tokens or view.disk_tokens
            else ""
        )
    )
    svg.text(12, 20, summary, 13, font_weight="bold", class_="summary")
    legend(
        svg,
        12,
        44,
        [
            (*COLOURS["pinned"], "pinned (shared prefix held for its branches)"),
            (*COLOURS["locked"], "locked (a running request)"),
            (*COLOURS["evictable"], "evictable"),
            (*COLOURS["hidden"], "summarised"),
        ],
    )
