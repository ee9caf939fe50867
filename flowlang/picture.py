"""A RequestGraph drawn as SVG: the program top to bottom, fork branches side by side.

Runs of text and roles become one prompt box; `gen` and `select` boxes give their prompt in
tokens (or say it holds generated text); a fork says how many prompt tokens its branches share
(computed once and pinned while they run). Boxes that later requests read as part of their
prompt are tinted as shared prefixes, with the number of requests that read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flowlang.graph import Branches, RequestGraph, RequestInfo, Stream
from flowlang.ir import Gen, Join, RoleBegin, RoleEnd, Select, Text
from runtime.prefix import common_prefix_len, union_prefix_tokens
from runtime.svg import Svg, fit, legend

BOX_W_PX = 290
GAP_PX = 22  # between branch columns
LINE_PX = 15
V_GAP_PX = 26  # between boxes in a column (room for the arrow)
MAX_TEXT_LINES = 4
COLOURS = {  # kind -> (fill, stroke)
    "text": ("#f4f4f4", "#888888"),
    "shared": ("#d6e6fa", "#2f6db5"),
    "gen": ("#d9f0d9", "#3f8a3f"),
    "select": ("#fbe8c8", "#c2731a"),
    "fork": ("#e6dcf7", "#6a3fb5"),
    "join": ("#e6dcf7", "#6a3fb5"),
}


@dataclass
class _Box:
    kind: str  # a COLOURS key
    title: str
    lines: list[str] = field(default_factory=list)
    prompt_ids: tuple[int, ...] | None = None  # a gen's or select's static prompt

    @property
    def height_px(self) -> float:
        return 10 + LINE_PX * (1 + len(self.lines))


@dataclass
class _Fork:
    box: _Box
    columns: list[list]  # each a list of _Box | _Fork


def graph_svg(graph: RequestGraph) -> str:
    """The graph as an SVG document (a string)."""
    requests = iter(graph.requests)
    blocks = _blocks(graph.root, requests)
    height_px = _height(blocks)
    width_px = max(_width(blocks), 520) + 24
    svg = Svg(width_px, height_px + 86, f"request graph of {graph.program}")
    _header(svg, graph)
    _draw_column(svg, blocks, 12, width_px - 24, 72, [])
    return str(svg)


# ---------------------------------------------------------------------- the blocks


def _blocks(stream: Stream, requests) -> list:
    """The stream as boxes and forks; `requests` yields the graph's RequestInfos in order."""
    blocks: list = []
    pending: list = []  # a run of Text / RoleBegin / RoleEnd, one box
    readers = _readers(stream)
    for i, item in enumerate(stream.items):
        if isinstance(item, Text | RoleBegin | RoleEnd):
            pending.append(item)
            continue
        if any(isinstance(p, Text) for p in pending):  # not a lone role end
            blocks.append(_prompt_box(pending, readers[i - 1]))
        pending = []
        if isinstance(item, Branches):
            columns = [_blocks(sub, requests) for sub in item.streams]
            blocks.append(_Fork(_fork_box(item, columns), columns))
        elif isinstance(item, Gen | Select):
            blocks.append(_request_box(item, next(requests, None), readers[i]))
        elif isinstance(item, Join):
            blocks.append(_Box("join", f"join {item.fork_id} ({item.mode})"))
    if any(isinstance(p, Text) for p in pending):
        blocks.append(_prompt_box(pending, 0))
    return blocks


def _readers(stream: Stream) -> list[int]:
    """For each item: how many requests come after it in this stream (branches included),
    i.e. read it as part of their prompt."""
    counts, after = [], 0
    for item in reversed(stream.items):
        counts.append(after)
        after += _num_requests(item)
    return counts[::-1]


def _num_requests(item) -> int:
    if isinstance(item, Branches):
        return sum(_num_requests(i) for sub in item.streams for i in sub.items)
    return int(isinstance(item, Gen | Select))


def _prompt_box(items: list, readers: int) -> _Box:
    lines, role, chars = [], None, 0
    for item in items:
        if isinstance(item, RoleBegin):
            role = item.role
        elif isinstance(item, RoleEnd):
            role = None
        else:
            chars += len(item.text)
            lines.append(f"{role or 'text'}: {item.text}")
    if len(lines) > MAX_TEXT_LINES:
        lines = lines[: MAX_TEXT_LINES - 1] + [f"\u2026 {len(lines) - MAX_TEXT_LINES + 1} more"]
    shared = readers >= 2
    title = f"text \u00b7 {chars:,} chars" + (
        f" \u00b7 read by {readers} requests" if shared else ""
    )
    return _Box("shared" if shared else "text", title, lines)


def _request_box(item: Gen | Select, info: RequestInfo | None, readers: int) -> _Box:
    kind = "gen" if isinstance(item, Gen) else "select"
    name = item.name or "(unnamed)"
    ids = None
    if info is None or info.kind != kind or info.name != item.name:
        prompt = "prompt unknown"
    elif info.prompt_ids is None:
        prompt = "prompt holds generated text"
    else:
        ids = info.prompt_ids
        prompt = f"prompt {len(ids):,} tok"
    if isinstance(item, Gen):
        detail = f"max {item.params.max_new_tokens} new tok"
        if item.constraint is not None:
            detail += " \u00b7 constrained"
    else:
        detail = f"{len(item.choices)} choices: " + " | ".join(c.strip() for c in item.choices)
    lines = [prompt, detail] + ([f"output read by {readers} requests"] if readers else [])
    return _Box(kind, f"{kind} {name}", lines, ids)


def _fork_box(item: Branches, columns: list[list]) -> _Box:
    firsts = [_first_request(column) for column in columns]
    prompts = [f for f in firsts if f is not None]
    if prompts and len(prompts) == len(firsts):
        shared = min(common_prefix_len(prompts[0], p) for p in prompts)
        lines = [f"shared prefix {shared:,} tok: computed once,"]
    else:
        lines = ["shared prefix: computed once,"]
    lines.append(f"pinned while the {item.fork.num_branches} branches run")
    return _Box("fork", f"fork {item.fork.fork_id} \u00d7{item.fork.num_branches}", lines)


def _first_request(column: list) -> tuple[int, ...] | None:
    for block in column:
        if isinstance(block, _Fork):
            return None  # the branch forks again before asking anything
        if block.kind in ("gen", "select"):
            return block.prompt_ids  # None: its prompt holds generated text
    return None


# ---------------------------------------------------------------------- layout and drawing


def _width(blocks: list) -> float:
    widths = [BOX_W_PX]
    for block in blocks:
        if isinstance(block, _Fork):
            inner = [_width(column) for column in block.columns]
            widths.append(sum(inner) + GAP_PX * (len(inner) - 1))
    return max(widths)


def _height(blocks: list) -> float:
    total = 0.0
    for block in blocks:
        if isinstance(block, _Fork):
            total += block.box.height_px + V_GAP_PX + max(map(_height, block.columns), default=0)
        else:
            total += block.height_px + V_GAP_PX
    return total


def _draw_column(
    svg: Svg, blocks: list, x_px: float, width_px: float, y_px: float, sources: list
) -> tuple[float, list]:
    """Draw `blocks` in a column `width_px` wide from `y_px`, with arrows in from `sources`
    (bottom-centre points); return the bottom and the points the next block's arrows leave."""
    for block in blocks:
        box = block.box if isinstance(block, _Fork) else block
        left = x_px + (width_px - BOX_W_PX) / 2
        for sx, sy in sources:
            svg.line(sx, sy, left + BOX_W_PX / 2, y_px - 2, stroke="#555", marker_end="url(#arrow)")
        _draw_box(svg, box, left, y_px)
        y_px += box.height_px
        sources = [(left + BOX_W_PX / 2, y_px)]
        y_px += V_GAP_PX
        if isinstance(block, _Fork):
            bottoms, ends, cx = [], [], x_px
            widths = [_width(c) for c in block.columns]
            cx += (width_px - sum(widths) - GAP_PX * (len(widths) - 1)) / 2
            for column, w in zip(block.columns, widths, strict=True):
                bottom, out = _draw_column(svg, column, cx, w, y_px, sources)
                bottoms.append(bottom)
                ends += out
                cx += w + GAP_PX
            y_px, sources = max(bottoms, default=y_px), ends
    return y_px, sources


def _draw_box(svg: Svg, box: _Box, x_px: float, y_px: float) -> None:
    fill, stroke = COLOURS[box.kind]
    svg.open_group(class_=f"box {box.kind}")
    svg.rect(x_px, y_px, BOX_W_PX, box.height_px, fill=fill, stroke=stroke, rx=5)
    svg.text(
        x_px + 8,
        y_px + 17,
        fit(box.title, BOX_W_PX - 14, 12),
        12,
        font_weight="bold",
        class_="title",
    )
    for i, line in enumerate(box.lines):
        y = y_px + 17 + LINE_PX * (i + 1)
        svg.text(x_px + 8, y, fit(line, BOX_W_PX - 14, 11), 11, fill="#333", class_="line")
    svg.close_group()


def _header(svg: Svg, graph: RequestGraph) -> None:
    prompts = graph.static_prompts()
    dynamic = len(graph.requests) - len(prompts)
    summary = (
        f"program {graph.program}: {len(graph.requests)} requests \u00b7 static prompts "
        f"{sum(map(len, prompts)):,} tok, {union_prefix_tokens(prompts):,} unique"
        + (f" \u00b7 {dynamic} prompts hold generated text" if dynamic else "")
    )
    svg.text(12, 20, summary, 13, font_weight="bold", class_="summary")
    if graph.partial_reason:
        svg.text(12, 36, fit(f"static part only: {graph.partial_reason}", 900, 11), 11, fill="#a33")
    legend(
        svg,
        12,
        56,
        [
            (*COLOURS["shared"], "shared prefix"),
            (*COLOURS["text"], "text"),
            (*COLOURS["gen"], "gen"),
            (*COLOURS["select"], "select"),
            (*COLOURS["fork"], "fork / join"),
        ],
    )
