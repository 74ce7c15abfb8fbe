"""The HTML of the report pages: one document with its CSS inlined, tables and sections.

A page must open offline, from a file, years later: nothing is linked (no stylesheet, script, font
or image from elsewhere), pictures are `data:` URIs or inline SVG, and the only links are anchors
and relative links to other report.html pages. Every string read from a run's files goes through
`esc`; only HTML this package builds (and an evaluator's section) is inserted as it is, marked
`Raw`. Every page names its writer in its head (GENERATOR), so that a page replaces only a page
vmoe wrote (`is_report_page`), never a file that happens to sit where a page goes."""
from __future__ import annotations

import base64
import hashlib
import html
import pathlib

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0;color:#1b1f24;
background:#fff}
main{max-width:1200px;margin:0 auto;padding:0 20px 40px}
header{padding:16px 20px;background:#f3f5f7;border-bottom:1px solid #d8dee4}
header h1{margin:0 0 4px;font-size:20px}
header p{margin:0;color:#57606a}
nav{margin-top:8px;font-size:13px}
nav a{margin-right:12px}
h2{margin:28px 0 8px;padding-bottom:4px;border-bottom:1px solid #d8dee4;font-size:17px}
h3{margin:16px 0 6px;font-size:14px}
a{color:#0969da}
table{border-collapse:collapse;margin:6px 0 12px;font-size:13px}
th,td{border:1px solid #d8dee4;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f6f8fa}
td.num{text-align:right;font-variant-numeric:tabular-nums}
tr.best td{background:#fff8c5;font-weight:600}
table.sortable th{cursor:pointer}
.banner{background:#fff1c2;border:1px solid #d4a72c;padding:10px 14px;margin:12px 0;
font-weight:600}
.note{color:#57606a;font-size:13px}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(400px,1fr));gap:10px}
figure{margin:0 0 12px}
figure svg,figure img{max-width:100%;height:auto}
figcaption{font-size:12px;color:#57606a}
pre{background:#f6f8fa;padding:8px;overflow:auto;font-size:12px;max-height:480px}
details{margin:6px 0}
code{font-size:12px}
.wide{overflow-x:auto}
"""

# Optional: click a header of a `sortable` table to sort its rows (the page reads the same
# without it). Allowed by the page's Content-Security-Policy through its hash, not as any script.
SORT_SCRIPT = """
document.querySelectorAll("table.sortable th").forEach(function (th, col) {
  th.title = "click to sort";
  th.addEventListener("click", function () {
    var body = th.closest("table").tBodies[0];
    var rows = Array.prototype.slice.call(body.rows);
    var up = th.dataset.dir !== "up";
    th.dataset.dir = up ? "up" : "down";
    function key(row) {
      var text = row.cells[th.cellIndex].textContent.trim();
      var x = parseFloat(text);
      return isNaN(x) ? text : x;
    }
    rows.sort(function (a, b) {
      var x = key(a), y = key(b);
      var order = (typeof x === typeof y) ? (x < y ? -1 : x > y ? 1 : 0)
                                           : (typeof x === "number" ? -1 : 1);
      return up ? order : -order;
    });
    rows.forEach(function (row) { body.appendChild(row); });
  });
});
"""

# What identifies a page vmoe report wrote: this tag, among the first bytes of the file. Pages
# written before it was added are known by their opening, the same since the first page.
GENERATOR = '<meta name="generator" content="vmoe report">'
_OPENING_BEFORE_GENERATOR = (
    '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">\n'
    '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; img-src data:; '
    "style-src 'unsafe-inline'; script-src ")
_HEAD_BYTES = 1024


def is_report_page(path: pathlib.Path) -> bool:
  """Whether `path` is a file that `page` wrote (an OSError if it cannot be read)."""
  with open(path, "rb") as file:
    head = file.read(_HEAD_BYTES).decode("utf-8", errors="replace")
  return GENERATOR in head or head.startswith(_OPENING_BEFORE_GENERATOR)


class Raw(str):
  """HTML built by this package: inserted as it is, where any other string is escaped."""


def esc(value) -> str:
  return value if isinstance(value, Raw) else html.escape(str(value), quote=True)


def link(href: str, text) -> Raw:
  return Raw(f'<a href="{html.escape(href, quote=True)}">{esc(text)}</a>')


def data_uri(content: bytes, mime: str) -> str:
  return f"data:{mime};base64,{base64.b64encode(content).decode('ascii')}"


def table(header: list | None, rows: list[list], *, numeric: bool = True, sortable: bool = False,
          row_classes: list[str] | None = None) -> Raw:
  """A table (no header row for `header=None`); a cell that reads as a number is right-aligned."""
  head = "".join(f"<th>{esc(h)}</th>" for h in header or [])
  body = []
  for i, row in enumerate(rows):
    cells = "".join(
        f'<td class="num">{esc(c)}</td>' if numeric and _numeric(c) else f"<td>{esc(c)}</td>"
        for c in row)
    cls = row_classes[i] if row_classes else ""
    body.append(f'<tr class="{cls}">{cells}</tr>' if cls else f"<tr>{cells}</tr>")
  kind = ' class="sortable"' if sortable else ""
  thead = f"<thead><tr>{head}</tr></thead>" if header else ""
  return Raw(f"<table{kind}>{thead}<tbody>{''.join(body)}</tbody></table>")


def _numeric(cell) -> bool:
  if isinstance(cell, Raw):
    return False
  try:
    float(str(cell).split(" ")[0].replace(",", ""))
    return True
  except ValueError:
    return False


def note(text) -> Raw:
  return Raw(f'<p class="note">{esc(text)}</p>')


def section(anchor: str, title: str, body: str) -> Raw:
  return Raw(f'<section id="{esc(anchor)}"><h2>{esc(title)}</h2>\n{body}\n</section>')


def figure(content: str, caption=None) -> Raw:
  text = f"<figcaption>{esc(caption)}</figcaption>" if caption else ""
  return Raw(f"<figure>{content}{text}</figure>")


def grid(items: list[str]) -> str:
  return f'<div class="grid">{"".join(items)}</div>' if items else ""


def page(title: str, subtitle: str, sections: list[tuple[str, str, str]],
         banner: str | None = None, script: bool = False) -> str:
  """The whole document: a header with a table of contents, then `sections` ((anchor, title,
  HTML body) each). Its Content-Security-Policy lets the browser fetch nothing at all, so a
  page that tried would show it as an error, and runs only the sort script."""
  sources = "'none'"
  if script:
    digest = base64.b64encode(hashlib.sha256(SORT_SCRIPT.encode()).digest()).decode()
    sources = f"'sha256-{digest}'"
  policy = f"default-src 'none'; img-src data:; style-src 'unsafe-inline'; script-src {sources}"
  toc = " ".join(f'<a href="#{esc(a)}">{esc(t)}</a>' for a, t, _ in sections)
  body = "\n".join(section(a, t, b) for a, t, b in sections)
  warning = f'<div class="banner" role="status">{esc(banner)}</div>' if banner else ""
  tail = f"<script>{SORT_SCRIPT}</script>" if script else ""
  return (
      "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n"
      f'<meta http-equiv="Content-Security-Policy" content="{policy}">\n{GENERATOR}\n'
      '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
      f"<title>{esc(title)}</title>\n<style>{CSS}</style></head>\n<body>\n"
      f"<header><h1>{esc(title)}</h1><p>{esc(subtitle)}</p><nav>{toc}</nav></header>\n"
      f"<main>{warning}\n{body}\n</main>\n{tail}</body></html>\n")
