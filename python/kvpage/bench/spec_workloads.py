"""The requests of ``kvpage bench spec``: chat messages written for the benchmark (never
from a hub), by workload.

* ``code_edit``: a Python function of 40-80 lines and an instruction to rename or add a
  parameter; the answer is the whole edited function, mostly the input again.
* ``extraction``: a passage and an instruction whose answer quotes it (copy the
  sentences about a subject, turn a list into JSON with the same values).
* ``chat``: open questions where little of the answer repeats the question (the case
  where speculation must stay out of the way).
"""

from __future__ import annotations

_INVENTORY = '''def restock_report(items, warehouse, threshold=5, supplier_lookup=None):
    """Return the items of a warehouse that need restocking, grouped by supplier."""
    report = {}
    skipped = []
    for item in items:
        if item.get("warehouse") != warehouse:
            continue
        count = item.get("count", 0)
        reserved = item.get("reserved", 0)
        available = count - reserved
        if available < 0:
            skipped.append(item["sku"])
            continue
        if available >= threshold:
            continue
        supplier = item.get("supplier")
        if supplier is None and supplier_lookup is not None:
            supplier = supplier_lookup(item["sku"])
        if supplier is None:
            supplier = "unknown"
        entry = {
            "sku": item["sku"],
            "name": item.get("name", ""),
            "available": available,
            "order": threshold * 2 - available,
        }
        report.setdefault(supplier, []).append(entry)
    for supplier, entries in report.items():
        entries.sort(key=lambda e: (e["available"], e["sku"]))
    totals = {
        supplier: sum(e["order"] for e in entries)
        for supplier, entries in report.items()
    }
    return {
        "warehouse": warehouse,
        "threshold": threshold,
        "suppliers": report,
        "totals": totals,
        "skipped": sorted(skipped),
    }
'''

_PARSER = '''def parse_log_line(line, default_level="INFO", strict=False):
    """Split one log line into its timestamp, level, module and message."""
    line = line.rstrip("\\n")
    if not line:
        return None
    parts = line.split(" ", 3)
    if len(parts) < 4:
        if strict:
            raise ValueError(f"malformed log line: {line!r}")
        return {
            "timestamp": None,
            "level": default_level,
            "module": None,
            "message": line,
        }
    date, time, level, rest = parts
    if not level.startswith("[") or not level.endswith("]"):
        if strict:
            raise ValueError(f"missing level in: {line!r}")
        rest = level + " " + rest
        level = default_level
    else:
        level = level[1:-1].upper()
    module = None
    if ":" in rest:
        head, tail = rest.split(":", 1)
        if " " not in head:
            module = head
            rest = tail.strip()
    timestamp = date + "T" + time
    return {
        "timestamp": timestamp,
        "level": level,
        "module": module,
        "message": rest,
    }
'''

_GEOMETRY = '''def polygon_stats(points, closed=True, precision=3):
    """Perimeter, area and centroid of a polygon given as (x, y) pairs."""
    if len(points) < 3:
        raise ValueError("a polygon needs at least three points")
    perimeter = 0.0
    area = 0.0
    cx = 0.0
    cy = 0.0
    count = len(points)
    last = count if closed else count - 1
    for i in range(last):
        x0, y0 = points[i]
        x1, y1 = points[(i + 1) % count]
        dx = x1 - x0
        dy = y1 - y0
        perimeter += (dx * dx + dy * dy) ** 0.5
        cross = x0 * y1 - x1 * y0
        area += cross
        cx += (x0 + x1) * cross
        cy += (y0 + y1) * cross
    area *= 0.5
    if area == 0:
        centroid = None
    else:
        centroid = (
            round(cx / (6.0 * area), precision),
            round(cy / (6.0 * area), precision),
        )
    return {
        "perimeter": round(perimeter, precision),
        "area": round(abs(area), precision),
        "centroid": centroid,
        "clockwise": area < 0,
    }
'''

CODE_EDIT = [
    "Rename the parameter `threshold` to `min_available` everywhere in this function. "
    "Answer with the whole edited function only.\n\n" + _INVENTORY,
    "Add a parameter `source=None` after `strict` and include it as a `\"source\"` key "
    "in every returned dict. Answer with the whole edited function only.\n\n" + _PARSER,
    "Rename the parameter `precision` to `digits` everywhere in this function. Answer "
    "with the whole edited function only.\n\n" + _GEOMETRY,
]

_REPORT = (
    "The harbour authority met on Tuesday. The eastern pier will close for repairs from "
    "March to May. Ferry services to the islands continue from the western pier. The "
    "fish market moves to the old customs house during the works. Parking near the "
    "eastern pier is suspended until June. A new timetable for the island ferries will "
    "be published next week. The harbour cafe stays open throughout. Cyclists should use "
    "the coastal path, because the pier road is closed to all traffic during the repairs."
)
_INVENTORY_TEXT = (
    "Order 4471: 12 steel brackets at 3.50 each, 4 oak shelves at 27.00 each, 1 box of "
    "wood screws at 8.25, 2 tins of varnish at 14.90 each, 6 wall anchors at 0.80 each, "
    "3 hinges at 5.10 each."
)
EXTRACTION = [
    "Copy, word for word, every sentence of this notice that mentions the eastern pier. "
    "Write nothing else.\n\n" + _REPORT,
    "Rewrite this order as a JSON list of objects with the keys item, quantity and "
    "unit_price, keeping the item names exactly as written.\n\n" + _INVENTORY_TEXT,
    "Repeat the following notice exactly, but replace every occurrence of 'pier' with "
    "'jetty'.\n\n" + _REPORT,
]

CHAT = [
    "Write a short poem about the first frost of autumn.",
    "Explain in a few sentences why the sky looks blue during the day.",
    "Give three ideas for a rainy-day activity with children, with one sentence each.",
]

WORKLOADS: dict[str, list[str]] = {
    "code_edit": CODE_EDIT,
    "extraction": EXTRACTION,
    "chat": CHAT,
}
