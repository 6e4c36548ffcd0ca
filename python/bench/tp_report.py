"""bench_tp.py's report: the gains over NCCL, the table and the SVG plot
(no torch needed), and the ulps between two bf16 results."""

import math


def ulps_bf16(a_bits, b_bits):
    """Per-element distance in bf16 ulps between two int16 bit tensors (the
    same value of either sign of zero is 0 apart; NaNs are reported apart)."""
    import torch

    def ordered(b):
        x = b.to(torch.int32) & 0xFFFF
        return torch.where(x >= 0x8000, 0x8000 - x, x)

    return (ordered(a_bits) - ordered(b_bits)).abs()


# ---- reporting (no torch needed) ---------------------------------------------


def gains(rows):
    """Adds the allreduce share (step minus `none`) and the gain over NCCL
    to each timed row, from the rows of the same token count."""
    by = {}
    for r in rows:
        by.setdefault(r["tokens"], {})[r["backend"]] = r
    for r in rows:
        same = by[r["tokens"]]
        us = r.get("step_us")
        none = same.get("none", {}).get("step_us")
        nccl = same.get("nccl", {}).get("step_us")
        if isinstance(us, float):
            r["tokens_per_s"] = round(r["tokens"] * 1e6 / us, 1)
            if isinstance(none, float) and r["backend"] != "none":
                r["allreduce_us"] = round(us - none, 1)
                r["allreduce_share"] = round((us - none) / us, 3)
            if isinstance(nccl, float):
                r["gain_over_nccl"] = round(nccl / us, 3)
    return rows


def table(rows, pattern):
    def cell(r, k, fmt):
        v = r.get(k)
        return fmt.format(v) if isinstance(v, (int, float)) else "-"

    if pattern == "verify":
        out = ["| tokens | bytes per allreduce | backend | allreduces | step us | us per allreduce | gain over NCCL |",
               "|---|---|---|---|---|---|---|"]
        for r in rows:
            us = r.get("step_us")
            per = cell(r, "per_allreduce_us", "{:.2f}")
            step = f"{us:.1f}" if isinstance(us, float) else str(r.get("skipped", "-"))
            out.append(f"| {r['tokens']} | {r['bytes']} | {r['backend']} | {r['allreduces']} | {step} | {per} | "
                       f"{cell(r, 'gain_over_nccl', '{:.2f}x')} |")
        return "\n".join(out)
    out = ["| tokens | backend | step us | tokens/s | allreduce us (step - none) | allreduce share | gain over NCCL | "
           "ulps from ours (max) | checks |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        us = r.get("step_us")
        step = f"{us:.1f}" if isinstance(us, float) else str(r.get("skipped", "-"))
        share = r.get("allreduce_share")
        out.append(
            f"| {r['tokens']} | {r['backend']} | {step} | {cell(r, 'tokens_per_s', '{:.1f}')} | "
            f"{cell(r, 'allreduce_us', '{:.1f}')} | {f'{100 * share:.1f}%' if isinstance(share, float) else '-'} | "
            f"{cell(r, 'gain_over_nccl', '{:.2f}x')} | {cell(r, 'max_ulps_vs_ours', '{}')} | {r.get('checks', '-')} |")
    return "\n".join(out)


def svg_plot(rows, title, path):
    """Step latency against tokens per step, one line per backend (log x),
    as a plain SVG file."""
    series = {}
    for r in rows:
        if isinstance(r.get("step_us"), float):
            series.setdefault(r["backend"], []).append((r["tokens"], r["step_us"] / 1000.0))
    W, H, L, R, T, B = 720, 440, 70, 150, 40, 50
    xs = sorted({t for pts in series.values() for t, _ in pts}) or [1]
    ymax = max([y for pts in series.values() for _, y in pts] or [1.0]) * 1.1
    lx0, lx1 = math.log2(xs[0]), math.log2(xs[-1]) if xs[-1] > xs[0] else math.log2(xs[0]) + 1

    def px(t):
        return L + (math.log2(t) - lx0) / (lx1 - lx0) * (W - L - R)

    def py(y):
        return H - B - y / ymax * (H - T - B)

    colours = {"nccl": "#d62728", "ours": "#1f77b4", "ours-fused": "#2ca02c", "best-of-both": "#ff7f0e",
               "symm-mem": "#9467bd", "none": "#7f7f7f"}
    e = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
         f'<rect width="{W}" height="{H}" fill="white"/>',
         f'<text x="{W / 2}" y="20" text-anchor="middle" font-size="14">{_esc(title)}</text>',
         f'<line x1="{L}" y1="{H - B}" x2="{W - R}" y2="{H - B}" stroke="black"/>',
         f'<line x1="{L}" y1="{T}" x2="{L}" y2="{H - B}" stroke="black"/>',
         f'<text x="{(L + W - R) / 2}" y="{H - 12}" text-anchor="middle">tokens per step</text>',
         f'<text x="16" y="{(T + H - B) / 2}" text-anchor="middle" transform="rotate(-90 16 {(T + H - B) / 2})">'
         'step latency (ms)</text>']
    for t in xs:
        e.append(f'<text x="{px(t):.1f}" y="{H - B + 16}" text-anchor="middle">{t}</text>')
    for i in range(6):
        y = ymax * i / 5
        e.append(f'<text x="{L - 6}" y="{py(y) + 4:.1f}" text-anchor="end">{y:.2f}</text>')
        e.append(f'<line x1="{L}" y1="{py(y):.1f}" x2="{W - R}" y2="{py(y):.1f}" stroke="#ddd"/>')
    for i, (name, pts) in enumerate(sorted(series.items())):
        c = colours.get(name, "#000")
        pts = sorted(pts)
        e.append(f'<polyline fill="none" stroke="{c}" stroke-width="2" points="'
                 + " ".join(f"{px(t):.1f},{py(y):.1f}" for t, y in pts) + '"/>')
        for t, y in pts:
            e.append(f'<circle cx="{px(t):.1f}" cy="{py(y):.1f}" r="3" fill="{c}"/>')
        e.append(f'<line x1="{W - R + 10}" y1="{T + 18 * i + 6}" x2="{W - R + 30}" y2="{T + 18 * i + 6}" '
                 f'stroke="{c}" stroke-width="2"/>')
        e.append(f'<text x="{W - R + 36}" y="{T + 18 * i + 10}">{_esc(name)}</text>')
    e.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(e) + "\n")


def _esc(s):
    return str(s).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
