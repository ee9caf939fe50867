"""A small SVG writer for the pictures (the radix tree, request graphs).

Torch-free and dependency-free, so `flowlang` (torch-free) and the server's dashboard both draw
with it. Text widths are estimated from character counts: labels are cut to fit boxes, so no
font metrics are needed.
"""

from __future__ import annotations

from html import escape

FONT = "DejaVu Sans, Helvetica, Arial, sans-serif"
CHAR_WIDTH = 0.6  # an upper estimate of a character's width, in font sizes


def text_width(text: str, font_px: float) -> float:
    """Estimated width of `text` in pixels."""
    return len(text) * font_px * CHAR_WIDTH


def fit(text: str, width_px: float, font_px: float) -> str:
    """`text` on one line, cut with an ellipsis to fit `width_px`."""
    text = " ".join(text.split())
    most = max(1, int(width_px / (font_px * CHAR_WIDTH)))
    return text if len(text) <= most else text[: max(0, most - 1)] + "\u2026"


def _attrs(attrs: dict[str, object]) -> str:
    return "".join(
        f' {name.rstrip("_").replace("_", "-")}="{escape(str(value), quote=True)}"'
        for name, value in attrs.items()
        if value is not None
    )


class Svg:
    """An SVG document built element by element; `str()` gives the markup."""

    def __init__(self, width_px: float, height_px: float, title: str = "") -> None:
        self.width_px = width_px
        self.height_px = height_px
        self.title = title
        self._parts: list[str] = []

    def rect(self, x: float, y: float, w: float, h: float, **attrs: object) -> None:
        self._parts.append(f"<rect{_attrs({'x': x, 'y': y, 'width': w, 'height': h, **attrs})}/>")

    def line(self, x1: float, y1: float, x2: float, y2: float, **attrs: object) -> None:
        self._parts.append(f"<line{_attrs({'x1': x1, 'y1': y1, 'x2': x2, 'y2': y2, **attrs})}/>")

    def path(self, d: str, **attrs: object) -> None:
        self._parts.append(f"<path{_attrs({'d': d, **attrs})}/>")

    def text(self, x: float, y: float, content: str, font_px: float = 12, **attrs: object) -> None:
        attrs = {"x": x, "y": y, "font_size": font_px, **attrs}
        self._parts.append(f"<text{_attrs(attrs)}>{escape(content, quote=False)}</text>")

    def open_group(self, **attrs: object) -> None:
        self._parts.append(f"<g{_attrs(attrs)}>")

    def close_group(self) -> None:
        self._parts.append("</g>")

    def __str__(self) -> str:
        w, h = round(self.width_px), round(self.height_px)
        head = (
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
            f'viewBox="0 0 {w} {h}" font-family="{FONT}">'
        )
        title = f"<title>{escape(self.title, quote=False)}</title>" if self.title else ""
        arrow = (
            '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
            'markerHeight="7" orient="auto-start-reverse"><path d="M0,0L10,5L0,10z" '
            'fill="#555"/></marker></defs>'
        )
        background = f'<rect x="0" y="0" width="{w}" height="{h}" fill="white"/>'
        return head + title + arrow + background + "".join(self._parts) + "</svg>"


def legend(svg: Svg, x: float, y: float, entries: list[tuple[str, str, str]]) -> float:
    """Draw (fill, stroke, label) swatches in a row from (x, y); return the right edge."""
    for fill, stroke, label in entries:
        svg.rect(x, y - 10, 14, 12, fill=fill, stroke=stroke, rx=2)
        svg.text(x + 19, y, label, 11, fill="#333")
        x += 19 + text_width(label, 11) + 14
    return x
