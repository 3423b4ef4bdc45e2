"""``index.html`` in a run's (or a sweep's) directory: one self-contained page a person opens in
a browser, written by ``python -m mpilearn.report``. No network and no script: the CSS is
inline, the images are the run's own PNGs, referenced by their path relative to the page
(``report/losses.png``, ``validation/epoch0004/spectra.png``), so the directory can be copied
or served as it is.

A run's page: its summary, the physics table (each number beside its MC-vs-MC floor, the ratio
and a verdict in words), every plot, the cost, membership changes and restarts, the noise
scale where the epoch records have one (``"noise_scale": {optimizer: {...}}``: whatever keys
are there are shown), and the config.
"""
from __future__ import annotations

import glob
import html
import math
import os
from typing import Iterable, List, Optional, Sequence

from ..core.io import atomic_write_text

STYLE = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:2em auto;max-width:75em;
padding:0 1em;color:#1d1d1f;line-height:1.45}
h1{font-size:1.6em}h2{margin-top:2em;border-bottom:1px solid #ddd;padding-bottom:.2em}
table{border-collapse:collapse;margin:.5em 0 1em}th,td{border:1px solid #ddd;padding:.25em .6em;
text-align:left;vertical-align:top}th{background:#f5f5f7}td.n{text-align:right;
font-variant-numeric:tabular-nums}pre{background:#f5f5f7;padding:.8em;overflow-x:auto;
font-size:.85em}figure{display:inline-block;margin:.5em 1em .5em 0;vertical-align:top}
figure img{max-width:100%;border:1px solid #eee}figcaption{font-size:.85em;color:#555}
.note{color:#555;font-size:.9em}details{margin:.5em 0}summary{cursor:pointer;font-weight:600}
"""

# a ratio to the MC-vs-MC floor at or below this reads as "at the MC floor": two MC samples'
# own ratio scatters around 1 by the floor's noise
AT_FLOOR = 2.0


SIGMAS = 3.0  # a distance from a floor that is 0 within its error: within this, not told apart


def verdict(ratio: Optional[float], name: str = "", value=None, floor=None,
            sigma: Optional[float] = None) -> str:
    """A physics number's ratio to its MC-vs-MC floor in words (lower is better; 1 = as good as
    the simulation), or, where the floor is 0 within its error (FPD, KPD), its distance from
    it in σ. A classifier AUC reads in its own terms: 0.5 cannot tell, 1.0 always can."""
    if _number(sigma):
        if sigma < SIGMAS:
            return f"at the MC floor (within {SIGMAS:g} σ)"
        return f"{sigma:.3g} σ from the MC floor: told from the MC"
    if name.startswith("auc") and _number(value):
        if _number(floor) and value <= max(floor, 0.5) + 0.05:
            return "at the MC floor: the classifier cannot tell them from MC"
        return (f"the classifier tells them from MC (AUC {value:.3g}; "
                f"{'the MC floor ' + format(floor, '.3g') if _number(floor) else '0.5'} = "
                "cannot tell, 1 = always)")
    if not _number(ratio):
        return ""
    if ratio <= AT_FLOOR:
        return "at the MC floor"
    return f"{ratio:.3g}x the MC floor" + (" (far off)" if ratio > 100 else "")


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def esc(v) -> str:
    return html.escape(str(v), quote=True)


def fmt(v) -> str:
    if isinstance(v, bool) or v is None:
        return "" if v is None else str(v).lower()
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else str(v)
    return str(v)


class Page:
    """An HTML page built section by section; ``write`` puts it at ``path``."""

    def __init__(self, title: str, base: str):
        self.title, self.base, self.parts = title, base, []

    def add(self, raw: str) -> None:
        self.parts.append(raw)

    def heading(self, text: str) -> None:
        self.add(f"<h2>{esc(text)}</h2>")

    def para(self, text: str, cls: str = "") -> None:
        self.add(f"<p{' class=' + chr(34) + cls + chr(34) if cls else ''}>{esc(text)}</p>")

    def pre(self, text: str) -> None:
        self.add(f"<pre>{esc(text)}</pre>")

    def table(self, header: Sequence[str], rows: Iterable[Sequence]) -> None:
        head = "".join(f"<th>{esc(h)}</th>" for h in header)
        body = "".join(
            "<tr>" + "".join(f'<td class="n">{esc(fmt(c))}</td>' if _number(c) and not
                             isinstance(c, bool) else f"<td>{esc(fmt(c))}</td>" for c in row)
            + "</tr>" for row in rows)
        self.add(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")

    def figures(self, paths: List[str]) -> None:
        """The images at ``paths`` (files), by their path relative to the page."""
        for path in paths:
            rel = os.path.relpath(path, self.base).replace(os.sep, "/")
            name = os.path.basename(path)
            self.add(f'<figure><img src="{esc(rel)}" alt="{esc(name)}">'
                     f"<figcaption>{esc(rel)}</figcaption></figure>")

    def write(self, path: str) -> None:
        atomic_write_text(path, (
            '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            '<link rel="icon" href="data:,">'  # no favicon request: nothing but the page's files
            f"<title>{esc(self.title)}</title><style>{STYLE}</style></head><body>"
            f"<h1>{esc(self.title)}</h1>\n" + "\n".join(self.parts) + "\n</body></html>\n"))


def finish(page: Page, run_dir: str) -> str:
    """The run's config last, then the page into ``RUN/index.html``; returns its path."""
    page.heading("Config")
    config = os.path.join(run_dir, "config.yaml")
    page.pre(open(config).read() if os.path.exists(config) else "(no config.yaml)")
    path = os.path.join(run_dir, "index.html")
    page.write(path)
    return path


def physics_rows(physics: dict) -> List[list]:
    """[metric, epoch, value, floor, ratio or σ, verdict] per metric of a report summary."""
    def floor(p):
        err = p.get("floor_error")
        return f"{p['floor']:.4g} ± {err:.2g}" if _number(p.get("floor")) and _number(err) \
            else p.get("floor")

    def distance(p):
        return f"{p['sigma']:.3g} σ" if _number(p.get("sigma")) else p.get("ratio")

    return [[name, p.get("epoch"), p.get("value"), floor(p), distance(p),
             verdict(p.get("ratio"), name, p.get("value"), p.get("floor"), p.get("sigma"))]
            for name, p in physics.items()]


def published_rows(physics: dict) -> List[list]:
    """[metric, Geant4 against itself, best entry, GANs, this run's value and place] for the
    metrics of a report summary that the CaloChallenge published (``calo/published.py``)."""
    from ..calo.published import POINTS, gans_text, place

    rows = []
    for name, p in physics.items():
        if name in POINTS:
            geant4, (best, value), _ = POINTS[name]
            placed = place(name, p.get("value"))
            rows.append([name, f"{geant4:.3g}", f"{value:.3g} ({best})", gans_text(name),
                         fmt(p.get("value")) + (f": {placed}" if placed else "")])
    return rows


def noise_rows(records: List[dict]) -> tuple:
    """(header, rows) of the epoch records' noise-scale measurements: one row per epoch and
    optimizer, a column per key any of them has (the measurement's keys may grow)."""
    keys: List[str] = []
    rows = []
    for r in records:
        ns = r.get("noise_scale")
        if not isinstance(ns, dict):
            continue
        for opt, values in ns.items():
            values = values if isinstance(values, dict) else {"value": values}
            for k in values:
                if k not in keys:
                    keys.append(k)
            rows.append((r.get("epoch"), opt, values))
    return (["epoch", "optimizer"] + keys,
            [[e, opt] + [v.get(k) for k in keys] for e, opt, v in rows])


def ranks_text(s: dict) -> str:
    """"3" or, where the rank count changed, "3 -> 2" (from the first launch's size)."""
    sizes = s.get("rank_history") or [s.get("ranks")]
    return " -> ".join(str(n) for n in sizes)


def launch_rows(costs: dict) -> List[list]:
    """[launch, ranks, exit status, devices, launched seconds] from the cost summary."""
    return [[l.get("launch"), l.get("ranks"), l.get("exit"), ", ".join(l.get("devices") or []),
             " - ".join(fmt(float(s)) for s in l.get("seconds") or [])]
            for l in costs.get("per_launch") or []]


def run_page(run_dir: str, summary: dict, records: List[dict], lines: List[str],
             cost_lines: List[str], costs: dict) -> str:
    """Writes ``RUN/index.html``; returns its path."""
    page = Page(f"mpilearn run {os.path.basename(os.path.abspath(run_dir))}", run_dir)
    page.para(f"{summary['epochs']} epoch(s) on {ranks_text(summary)} {summary['device']} "
              "rank(s); "
              f"{os.path.abspath(run_dir)}", "note")
    page.heading("Summary")
    page.pre("\n".join(lines))

    page.heading("Physics against the MC-vs-MC floor")
    if summary["physics"]:
        page.para("Each number is a distance from the simulation: lower is better. The floor is "
                  "the same number between two independent MC samples of the same size; the "
                  "ratio is number / floor, so 1 is as good as the simulation itself. Where the "
                  "floor is 0 within its error (FPD, KPD) the distance is in σ instead: "
                  "(number - floor) / its combined error; below 3 σ the two are not told apart.")
        page.table(["metric", "epoch", "value", "MC-vs-MC floor", "ratio or σ", "verdict"],
                   physics_rows(summary["physics"]))
        published = published_rows(summary["physics"])
        if published:
            from ..calo.published import SOURCE

            page.para(f"Published reference points ({SOURCE}, arXiv 2410.21611). FPD and KPD "
                      "are distances on the challenge's own features of its own geometry: "
                      "compare orders of magnitude only. The classifier AUCs read alike (0.5: "
                      "cannot tell, 1: always can); this run's classifier is smaller than the "
                      "challenge's, so it can only tell less.")
            page.table(["metric", "Geant4 against itself", "best entry", "GANs", "this run"],
                       published)
    else:
        page.para("No physics numbers: this run logged no metric with a floor (the 3DGAN logs "
                  "them with train.validate_every).", "note")

    page.heading("Plots")
    report_pngs = [os.path.join(run_dir, "report", n) for n in
                   ("losses.png", "physics.png", "throughput.png", "cost.png",
                    "noise_scale.png")]
    page.figures([p for p in report_pngs if os.path.exists(p)])
    epochs = sorted(glob.glob(os.path.join(run_dir, "validation", "epoch*")))
    for i, folder in enumerate(reversed(epochs)):
        pngs = sorted(glob.glob(os.path.join(folder, "*.png")))
        if not pngs:
            continue
        page.add(f"<details{' open' if i == 0 else ''}><summary>physics plots, "
                 f"{esc(os.path.basename(folder))}</summary>")
        page.figures(pngs)
        page.add("</details>")
    others = sorted(p for p in glob.glob(os.path.join(run_dir, "validation", "*", "*.png"))
                    if os.path.dirname(p) not in epochs)
    if others:
        page.add("<details><summary>other physics plots</summary>")
        page.figures(others)
        page.add("</details>")

    page.heading("Cost")
    page.pre("\n".join(cost_lines))
    rows = launch_rows(costs)
    if rows:
        page.table(["launch", "ranks", "exit status", "devices", "launched s (min - max rank)"],
                   rows)

    page.heading("Membership changes and restarts")
    changes = summary.get("membership") or []
    restarts = max(len(rows) - 1, 0)
    page.para(f"{len(rows)} launch(es): {restarts} restart(s) (a resume, a requeue or a "
              f"relaunch); {len(changes)} membership change(s) inside a launch; ranks "
              f"{ranks_text(summary)}.")
    if changes:
        page.table(["change"], [[c] for c in changes])

    header, noise = noise_rows(records)
    page.heading("Gradient noise scale")
    if noise:
        page.para("Per epoch and optimizer, as the engine measured it: b_simple is the simple "
                  "noise scale (the batch above which a larger batch buys little), "
                  "critical_batch its estimate of the critical batch, efficiency how much of "
                  "the global batch's gain the run gets.")
        page.table(header, noise)
    else:
        page.para("Not measured in this run (no noise_scale in metrics.jsonl).", "note")

    return finish(page, run_dir)


def sweep_page(run_dir: str, summary: dict, rows: List[dict], names: List[str],
               lines: List[str]) -> str:
    """Writes a sweep's ``RUN/index.html``; returns its path."""
    page = Page(f"mpilearn sweep {os.path.basename(os.path.abspath(run_dir))}", run_dir)
    page.para(os.path.abspath(run_dir), "note")
    page.heading("Summary")
    page.pre("\n".join(lines))
    page.heading("Trials")
    page.table(["trial", "status", "value", "std", "wall s", "origin", "requeued after"] + names,
               [[r["trial"], r["status"], r["value"], r["std"], r["wall"], r["origin"],
                 r.get("requeued_after", "")] + [r["params"].get(n) for n in names]
                for r in rows])
    page.heading("Plots")
    page.figures(sorted(glob.glob(os.path.join(run_dir, "report", "*.png"))))
    return finish(page, run_dir)
