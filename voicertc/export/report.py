"""A plain-text table (the package's copy of bench.report's, so `voicertc doctor` needs no checkout)."""

from __future__ import annotations


def text_table(rows: list[dict[str, object]]) -> str:
    if not rows:
        return "(no rows)"
    columns = list(rows[0])

    def fmt(v: object) -> str:
        if isinstance(v, float):
            return f"{v:.1f}" if abs(v) >= 10 else f"{v:.3f}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = [" | ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines.append("-+-".join("-" * w for w in widths))
    lines += [" | ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)
