"""``readout.html``: one self-contained page (no network, no external script, style or font) showing each document
with every read token tinted by its FVE; hovering or focusing a token (Tab moves between them) shows its
explanation(s), FVE and MSE. A summary on top: positions read, mean FVE and an FVE histogram."""
from __future__ import annotations

import html
import math

_STYLE = """
body{font:15px/1.6 system-ui,-apple-system,"Segoe UI",sans-serif;margin:2em auto;max-width:62em;padding:0 1em;color:#1d1d1f}
h1{font-size:1.3em;margin:0 0 .3em}
.summary{display:flex;gap:2em;align-items:flex-end;flex-wrap:wrap;margin-bottom:1.5em}
.summary dl{display:grid;grid-template-columns:auto auto;gap:.1em 1em;margin:0}
.summary dt{color:#666}.summary dd{margin:0;font-variant-numeric:tabular-nums}
.hist rect{fill:#4a7fb5}.hist text{font-size:10px;fill:#444}
.legend span{display:inline-block;padding:0 .4em;margin-right:.2em;border-radius:3px}
.doc{margin:1em 0;padding:.6em .8em;border:1px solid #ddd;border-radius:6px;white-space:pre-wrap;word-break:break-word}
.doc h2{font-size:.85em;color:#666;margin:0 0 .3em;font-weight:normal;white-space:normal}
.t{border-radius:2px;cursor:help;outline-offset:1px}
.t:focus{outline:2px solid #1d1d1f}
#tip{position:fixed;display:none;max-width:28em;background:#fff;border:1px solid #888;border-radius:6px;padding:.5em .7em;
box-shadow:0 2px 10px rgba(0,0,0,.2);font-size:13px;white-space:normal;pointer-events:none;z-index:10}
#tip .tok{font-family:ui-monospace,monospace;background:#eee;padding:0 .2em}
#tip ol{margin:.3em 0 0;padding-left:1.4em}#tip .best{font-weight:600}
"""

_SCRIPT = """
(function(){
var tip=document.getElementById('tip');
function show(el){
  var ex=JSON.parse(el.dataset.ex), ms=JSON.parse(el.dataset.ms), best=+el.dataset.best;
  var h='<div><span class="tok"></span> · position '+el.dataset.pos+'</div><div>FVE '+el.dataset.fve+' · MSE '+el.dataset.mse+'</div><ol>';
  for(var i=0;i<ex.length;i++){h+='<li'+(i===best?' class="best"':'')+'></li>';}
  tip.innerHTML=h+'</ol>';
  tip.querySelector('.tok').textContent=el.dataset.tok;
  var li=tip.querySelectorAll('li');
  for(var j=0;j<ex.length;j++){li[j].textContent=(ex[j]===null?'(no explanation)':ex[j])+(ms[j]===null?'':'  (MSE '+ms[j].toFixed(3)+')');}
  var r=el.getBoundingClientRect();tip.style.display='block';
  var top=r.bottom+6;if(top+tip.offsetHeight>innerHeight){top=r.top-tip.offsetHeight-6;}
  tip.style.top=Math.max(4,top)+'px';tip.style.left=Math.max(4,Math.min(r.left,innerWidth-tip.offsetWidth-8))+'px';
  tip.setAttribute('data-for',el.id);
}
function hide(){tip.style.display='none';tip.removeAttribute('data-for');}
document.querySelectorAll('.t').forEach(function(el){
  el.addEventListener('mouseenter',function(){show(el);});el.addEventListener('mouseleave',hide);
  el.addEventListener('focus',function(){show(el);});el.addEventListener('blur',hide);
});
document.addEventListener('keydown',function(e){if(e.key==='Escape'){hide();}});
})();
"""


def tint(fve: float | None) -> str:
    """Background for an FVE: red below 0 (worse than the mean), white at 0, green towards 1."""
    if fve is None or not math.isfinite(fve):
        return "#e0e0e0"
    x = max(-1.0, min(1.0, fve))
    if x >= 0:
        return f"rgba(46,160,67,{0.12 + 0.6 * x:.2f})"
    return f"rgba(215,58,73,{0.12 + 0.6 * -x:.2f})"


def _fmt(x: float | None) -> str:
    return "–" if x is None or not math.isfinite(x) else f"{x:+.3f}"


def histogram_svg(values: list[float], bins: int = 20, lo: float = -1.0, hi: float = 1.0) -> str:
    counts = [0] * bins
    for v in values:
        k = int((min(max(v, lo), hi - 1e-9) - lo) / (hi - lo) * bins)
        counts[k] += 1
    top = max(counts) or 1
    w, h, bw = 300, 80, 300 / bins
    bars = "".join(f'<rect x="{i * bw + 1:.1f}" y="{h - 12 - (h - 16) * c / top:.1f}" width="{bw - 2:.1f}" '
                   f'height="{(h - 16) * c / top:.1f}"><title>{lo + i * (hi - lo) / bins:+.1f}…: {c}</title></rect>'
                   for i, c in enumerate(counts))
    labels = (f'<text x="0" y="{h - 1}">{lo:+g}</text><text x="{w / 2 - 4}" y="{h - 1}">0</text>'
              f'<text x="{w - 18}" y="{h - 1}">{hi:+g}</text>')
    return f'<svg class="hist" width="{w}" height="{h}" role="img" aria-label="FVE histogram">{bars}{labels}</svg>'


def render(documents: list[dict], records: list[dict], title: str, about: str) -> str:
    """The page. ``documents``: ``doc_index``, ``doc_id``, ``tokens`` (every token's text); ``records``: the
    readout's rows (``doc_index``, ``token_index``, ``token``, ``explanation``, ``mse``, ``fve``, ``explanations``,
    ``mses``)."""
    import json

    by_doc: dict[int, dict[int, dict]] = {}
    for r in records:
        by_doc.setdefault(int(r["doc_index"]), {})[int(r["token_index"])] = r
    fves = [r["fve"] for r in records if r.get("fve") is not None and math.isfinite(r["fve"])]
    mean = sum(fves) / len(fves) if fves else None
    parts = [f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
             f"<meta name=\"viewport\" content=\"width=device-width,initial-scale=1\"><style>{_STYLE}</style></head><body>",
             f"<h1>{html.escape(title)}</h1><p>{html.escape(about)}</p>",
             "<div class=\"summary\"><dl>"
             f"<dt>documents</dt><dd>{len(documents)}</dd><dt>positions read</dt><dd id=\"n-read\">{len(records)}</dd>"
             f"<dt>mean FVE</dt><dd id=\"mean-fve\">{_fmt(mean)}</dd>"
             f"<dt>explained</dt><dd>{sum(1 for r in records if r.get('explanation'))}</dd></dl>",
             f"<div><div>FVE of the read positions</div>{histogram_svg(fves)}</div>",
             "<div class=\"legend\">FVE: " + "".join(f'<span style="background:{tint(v)}">{v:+g}</span>' for v in (-1, -0.5, 0, 0.5, 1))
             + "</div></div>"]
    for doc in documents:
        d = int(doc["doc_index"])
        read = by_doc.get(d, {})
        parts.append(f'<section class="doc" id="doc-{d}"><h2>{html.escape(str(doc["doc_id"]))} · {len(read)} of '
                     f'{len(doc["tokens"])} tokens read</h2>')
        for p, piece in enumerate(doc["tokens"]):
            r = read.get(p)
            if r is None:
                parts.append(html.escape(piece))
                continue
            mses = [None if m is None or not math.isfinite(m) else round(float(m), 6) for m in r["mses"]]
            mine = None if r["mse"] is None else round(float(r["mse"]), 6)
            best = next((j for j, e in enumerate(r["explanations"]) if e == r["explanation"] and mses[j] == mine), 0)
            order = [best] + [j for j in range(len(mses)) if j != best]  # the one the reconstructor reads best first
            attrs = {"id": f"t-{d}-{p}", "class": "t", "tabindex": "0", "style": f"background:{tint(r['fve'])}",
                     "data-pos": str(p), "data-tok": piece, "data-fve": _fmt(r["fve"]),
                     "data-mse": "–" if r["mse"] is None else f"{r['mse']:.3f}", "data-best": "0",
                     "data-ex": json.dumps([r["explanations"][j] for j in order], ensure_ascii=False),
                     "data-ms": json.dumps([mses[j] for j in order]),
                     "aria-label": f"{piece.strip() or 'token'}: {r['explanation'] or 'no explanation'}, FVE {_fmt(r['fve'])}"}
            parts.append("<span " + " ".join(f'{k}="{html.escape(v, quote=True)}"' for k, v in attrs.items()) + ">"
                         + html.escape(piece) + "</span>")
        parts.append("</section>")
    parts.append(f'<div id="tip" role="tooltip"></div><script>{_SCRIPT}</script></body></html>')
    return "".join(parts)
