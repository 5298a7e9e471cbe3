"""An evaluation's report for a reader: a Markdown page of tables, and a plot of each document's scores.

Both are made from ``run.report``'s object (what ``--json`` prints). The plot needs matplotlib (the ``evaluate``
extra): one column of points per system, each document's ROUGE-1 and ROUGE-L, the means marked.
"""

from __future__ import annotations

from unlimisum.visible import markdown_line

SHOWN = (("rouge1", "ROUGE-1"), ("rouge2", "ROUGE-2"), ("rougeL", "ROUGE-L"), ("rougeLsum", "ROUGE-Lsum"),
         ("entment", "EntMent"), ("bertscore", "BERTScore"))


def interval(estimate: dict, percent: bool = True) -> str:
    """``41.2 (38.0–44.1)``: a mean and its 95 % interval, as percentages of a score (or plain numbers)."""
    if percent:
        return f"{100 * estimate['mean']:.1f} ({100 * estimate['low']:.1f}–{100 * estimate['high']:.1f})"
    return f"{estimate['mean']:.1f} ({estimate['low']:.1f}–{estimate['high']:.1f})"


def markdown(report: dict, title: str = "Evaluation") -> str:
    """The report as Markdown: the systems' means with 95 % intervals, the paired differences, each document; the
    names and ids from the data and the command line escaped as Markdown text (unlimisum/visible.py)."""
    metrics = [(key, name) for key, name in SHOWN if any(key in system["metrics"] for system in report["systems"])]
    lines = [f"# {markdown_line(title)}", "",
             "Scores are F1 (ROUGE, BERTScore) or recall (EntMent), in percent: the mean over the documents and its "
             "95 % bootstrap interval.", "",
             "| system | documents | " + " | ".join(name for _, name in metrics) + " | words | seconds | check first |",
             "|---|---:|" + "---:|" * (len(metrics) + 3)]
    for system in report["systems"]:
        found = system["metrics"]
        cells = [interval(found[key]) if key in found else "–" for key, _ in metrics]
        cells += [interval(found[key], percent=False) if key in found else "–" for key in ("words", "seconds")]
        cells.append(f"{100 * found['check_first']['mean']:.0f} %" if "check_first" in found else "–")
        lines.append(f"| {markdown_line(system['name'])} | {len(system['documents'])} | " + " | ".join(cells) + " |")
    if report["paired"]:
        lines += ["", "Paired differences, unlimisum minus each baseline, over the documents both scored (points "
                  "of percent; an interval that excludes 0 holds beyond this sample of documents):", "",
                  "| baseline | metric | difference | 95 % interval |", "|---|---|---:|---|"]
        names = dict(SHOWN)
        for pair in report["paired"]:
            lines.append(f"| {markdown_line(pair['baseline'])} | {names.get(pair['metric'], pair['metric'])} | "
                         f"{100 * pair['difference']:+.1f} | {100 * pair['low']:+.1f} to {100 * pair['high']:+.1f} |")
    lines += ["", "Each document:", "", "| id | system | " + " | ".join(name for _, name in metrics) + " | words |",
              "|---|---|" + "---:|" * (len(metrics) + 1)]
    by_id: dict[str, list] = {}
    for system in report["systems"]:
        for document in system["documents"]:
            by_id.setdefault(document["id"], []).append((system["name"], document))
    for identity, rows in by_id.items():
        for name, document in rows:
            cells = [f"{100 * document[key]:.1f}" if document.get(key) is not None else "–" for key, _ in metrics]
            lines.append(f"| {markdown_line(str(identity))} | {markdown_line(name)} | " + " | ".join(cells)
                         + f" | {document['words']} |")
    return "\n".join(lines) + "\n"


def plot(report: dict, target) -> None:
    """A PNG of each document's ROUGE-1 and ROUGE-L per system, means marked, written to ``target`` (a path or a
    binary file); ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    systems = report["systems"]
    figure, axes = pyplot.subplots(1, 2, figsize=(4 + 1.6 * len(systems), 4), sharey=True)
    for axis, (key, name) in zip(axes, (("rouge1", "ROUGE-1"), ("rougeL", "ROUGE-L"))):
        for column, system in enumerate(systems):
            values = [100 * document[key] for document in system["documents"] if document.get(key) is not None]
            spread = [column + 0.15 * ((index % 7) - 3) / 3 for index in range(len(values))]
            axis.scatter(spread, values, s=14, alpha=0.6)
            if values:
                axis.hlines(sum(values) / len(values), column - 0.3, column + 0.3, colors="black", linewidth=2)
        axis.set_xticks(range(len(systems)), [system["name"] for system in systems])
        axis.set_title(f"{name} F1 per document (bar: the mean)")
        axis.set_ylim(0, 100)
        axis.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("percent")
    figure.tight_layout()
    figure.savefig(target, dpi=120, format="png")
    pyplot.close(figure)
