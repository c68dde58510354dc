"""The sweep report: one row per point, measured beside predicted, as Markdown, CSV and PNG plots.

    python -m experiments.report SWEEP_DIR        # any finished (or partly finished) sweep directory

Every job directory under SWEEP_DIR holding a `summary.json` is a point. The swept keys are the
job's Hydra overrides (`summary["overrides"]`). Predictions come from `summary["plan"]` when the
run logged one, else the planner is run on the job's saved `.hydra/config.yaml`.

Writes into SWEEP_DIR: report.md, report.csv, throughput_vs_memory.png, step_time_by_strategy.png.
At the end of a multirun the `SweepReportCallback` (a Hydra callback) does the same.
"""
from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path
from typing import Any, Optional

from hydra.experimental.callback import Callback

from core.errors import ConfigError
from core.planner import relative_error

# pipeline points add their bubble (rank 0's idle share of a step), the most activation bytes any rank saved for
# backward at once and the busiest rank's point-to-point MiB per step, each beside the planner's
MEASURED = [("tokens_per_s", "tokens/s"), ("mfu", "MFU"), ("step_time_ms", "step ms"),
            ("peak_mem_gib", "peak GiB"), ("exposed_comm_ms", "exposed comm ms"),
            ("dp_exposed_comm_ms", "of it dp ms"), ("tp_exposed_comm_ms", "of it tp ms"),
            ("cp_exposed_comm_ms", "of it cp ms"), ("ep_exposed_comm_ms", "of it ep ms"),
            ("pp_bubble_fraction", "pp bubble"),
            ("pp_activation_gib", "pp activations GiB"), ("pp_p2p_mib", "pp P2P MiB"), ("final_loss", "final loss")]
PREDICTED = [("tokens_per_s", "pred tokens/s"), ("step_time_ms", "pred step ms"), ("peak_mem_gib", "pred peak GiB"),
             ("exposed_comm_ms", "pred exposed comm ms"), ("tp_exposed_comm_ms", "pred tp ms"),
             ("cp_exposed_comm_ms", "pred cp ring ms"), ("ep_exposed_comm_ms", "pred ep ms"),
             ("pp_bubble_fraction", "pred pp bubble"), ("pp_activation_gib", "pred pp activations GiB"),
             ("pp_p2p_mib", "pred pp P2P MiB")]

# where a prediction's key differs from the measurement's: the planner gives the ring's whole send time (it runs
# beside the block attention, so the exposed part is at most that)
PLAN_KEY = {"cp_exposed_comm_ms": "cp_comm_ms"}


def _overrides(summary: dict[str, Any]) -> dict[str, str]:
    out = {}
    for o in summary.get("overrides") or []:
        if "=" in o:
            k, v = o.split("=", 1)
            out[k.lstrip("+~")] = v
    return out


def _plan_for(job_dir: Path, summary: dict[str, Any]) -> Optional[dict[str, Any]]:
    if isinstance(summary.get("plan"), dict):
        return summary["plan"]
    cfg_file = job_dir / ".hydra" / "config.yaml"
    if not cfg_file.is_file():
        return None
    try:
        from omegaconf import OmegaConf

        from core.planner import plan

        cfg = OmegaConf.load(cfg_file)
        return plan(cfg).to_dict()
    except Exception:  # noqa: BLE001 - a point without a prediction still gets its row
        return None


def collect(sweep_dir: str | Path) -> list[dict[str, Any]]:
    """One dict per job: job dir, status, error, swept keys, measured and predicted numbers."""
    sweep_dir = Path(sweep_dir)
    rows = []
    for path in sorted(sweep_dir.rglob("summary.json"), key=lambda p: _job_sort_key(p.parent, sweep_dir)):
        if "checkpoints" in path.parts:
            continue
        try:
            summary = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            summary = {"status": "failed", "error": f"unreadable summary.json: {e}"}
        job = path.parent
        row: dict[str, Any] = {"job": str(job.relative_to(sweep_dir)) or ".", "status": summary.get("status", "?"),
                               "error": summary.get("error"), "signal": summary.get("signal"),
                               "swept": _overrides(summary)}
        peaks = summary.get("peak_mem_gib_per_rank")
        row["peak_mem_gib_per_rank"] = peaks if isinstance(peaks, list) else None
        for k, _ in MEASURED:
            row[k] = summary.get(k)
        p = row["plan"] = _plan_for(job, summary)
        for k, _ in PREDICTED:
            row["pred_" + k] = p.get(PLAN_KEY.get(k, k)) if p else None
        row["strategy"] = row["swept"].get("parallelism") or summary.get("parallelism") or "?"
        row["mesh"] = mesh_name(row["swept"], summary.get("mesh"))
        row["device"] = summary.get("device")
        rows.append(row)
    return rows


def mesh_name(swept: dict[str, str], described: Optional[str]) -> str:
    """The mesh as the user typed it: the preset (`mesh=dp2`) and any `mesh.*` key overrides, else the run's own
    name for it (`ParallelMesh.describe()`)."""
    parts = [swept["mesh"]] if "mesh" in swept else []
    parts += [f"{k.split('.', 1)[1]}={v}" for k, v in sorted(swept.items())
              if k.startswith("mesh.") and k not in ("mesh.device", "mesh.timeout_s")]
    return " ".join(parts) if parts else (described or "?")


def _job_sort_key(job: Path, root: Path):
    name = job.relative_to(root).parts[0] if job != root else ""
    head = name.split("_", 1)[0]
    return (int(head) if head.isdigit() else math.inf, str(job))


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if not math.isfinite(v):
            return "-"
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        if abs(v) < 1:
            return f"{v:.3f}"
        return f"{v:.2f}"
    if isinstance(v, list):
        return " / ".join(_fmt(x) for x in v)
    return str(v)


def table(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """Header and rows (raw values) shared by the Markdown and CSV outputs."""
    keys = sorted({k for r in rows for k in r["swept"]})
    # columns for the keys that vary; a key every point shares is stated once above the table
    swept = [k for k in keys if len({r["swept"].get(k) for r in rows}) > 1] or keys
    header = ["job", "status", *swept]
    # a column no point has a value for (tp time in a sweep without tensor parallelism) is left out
    measured = [(k, t) for k, t in MEASURED if any(r.get(k) is not None or r.get("pred_" + k) is not None for r in rows)]
    for k, title in measured:
        header.append(title)
        pred = next((t for pk, t in PREDICTED if pk == k), None)
        if pred:
            header.append(pred)
    header += ["peak GiB per rank", "error"]
    body = []
    for r in rows:
        line = [r["job"], r["status"], *[r["swept"].get(k) for k in swept]]
        for k, _ in measured:
            line.append(r[k])
            if any(pk == k for pk, _ in PREDICTED):
                line.append(r["pred_" + k])
        line += [r["peak_mem_gib_per_rank"], r["error"]]
        body.append(line)
    return header, body


# How close the planner aims to be (docs/planner.md): predicted step time within 25% of the measured one,
# predicted peak memory within 10%.
STEP_TOLERANCE, MEMORY_TOLERANCE = 0.25, 0.10


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def prediction_errors(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown lines: per finished point, (predicted - measured) / measured for step time and peak memory,
    and how many points fall within the planner's tolerances."""
    def err(r: dict[str, Any], k: str) -> Optional[float]:
        if k == "peak_mem_gib" and r.get("device") == "cpu":
            return None  # the CPU's only figure is process RSS, not the tensor bytes the planner predicts
        return relative_error(r.get("pred_" + k), r.get(k))

    done = [r for r in rows if r["status"] == "ok"]
    if not done and any(r["status"] == "planned" for r in rows):
        return []  # a plan-only sweep measured nothing
    cpu = any(r.get("device") == "cpu" for r in done)
    lines = ["## Prediction against measurement", "",
             "Error = (predicted - measured) / measured (core.planner.relative_error)."
             + (" Peak memory is not compared on the CPU: its measured figure is process RSS, not tensor bytes."
                if cpu else ""), "",
             "| job | step ms pred / measured | error | peak GiB pred / measured | error |",
             "|---|---|---|---|---|"]
    within = {"step_time_ms": [], "peak_mem_gib": []}
    for r in done:
        cells = [r["job"]]
        for k, tol in (("step_time_ms", STEP_TOLERANCE), ("peak_mem_gib", MEMORY_TOLERANCE)):
            e = err(r, k)
            cells += [f"{_fmt(r.get('pred_' + k))} / {_fmt(r.get(k))}", "-" if e is None else f"{e * 100:+.0f}%"]
            if e is not None:
                within[k].append(abs(e) <= tol)
        lines.append("| " + " | ".join(_md_cell(c) for c in cells) + " |")
    lines += ["", f"Step time within {STEP_TOLERANCE:.0%}: {sum(within['step_time_ms'])} of "
              f"{len(within['step_time_ms'])} points. Peak memory within {MEMORY_TOLERANCE:.0%}: "
              f"{sum(within['peak_mem_gib'])} of {len(within['peak_mem_gib'])} points.", ""]
    return lines


def ranking(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown lines: the finished points ranked by measured tokens/s (equal global batches: by step time), each
    with the rank the planner's prediction gives it, and whether the planner picks the same best three in order."""
    done = [r for r in rows if r["status"] in FINISHED and not r.get("signal") and r.get("tokens_per_s")]
    if len(done) < 2:
        return planned_ranking(rows)
    labels = dict(zip((r["job"] for r in done), point_labels(done)))
    measured = sorted(done, key=lambda r: -r["tokens_per_s"])
    predicted = sorted((r for r in done if r.get("pred_tokens_per_s")), key=lambda r: -r["pred_tokens_per_s"])
    pred_rank = {r["job"]: i + 1 for i, r in enumerate(predicted)}
    lines = ["## Ranking", "", "Finished points, fastest first (measured tokens/s); `planner rank` orders the same "
             "points by predicted tokens/s.", "",
             "| rank | point | tokens/s | step ms | peak GiB | planner rank | pred tokens/s |",
             "|---|---|---|---|---|---|---|"]
    for i, r in enumerate(measured):
        cells = [str(i + 1), f"{labels[r['job']]} (#{r['job'].split('_', 1)[0]})", _fmt(r["tokens_per_s"]), _fmt(r["step_time_ms"]),
                 _fmt(r["peak_mem_gib"]), str(pred_rank.get(r["job"], "-")), _fmt(r.get("pred_tokens_per_s"))]
        lines.append("| " + " | ".join(_md_cell(c) for c in cells) + " |")
    top = min(3, len(measured))
    if len(predicted) == len(measured):
        same = [r["job"] for r in measured[:top]] == [r["job"] for r in predicted[:top]]
        lines += ["", f"The planner's best {top} in the measured order: {'yes' if same else 'no'}."]
    return lines + [""]


def planned_ranking(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown lines for a plan-only sweep (`python train.py -m plan=true ...`): the points ranked by the planner's
    tokens/s, with its step time, peak memory per rank and exposed communication per axis."""
    planned = sorted((r for r in rows if r["status"] == "planned" and r.get("pred_tokens_per_s")),
                     key=lambda r: -r["pred_tokens_per_s"])
    if not planned:
        return []
    labels = dict(zip((r["job"] for r in planned), point_labels(planned)))
    axes = [(k, t) for k, t in (("tp_exposed_comm_ms", "tp"), ("cp_exposed_comm_ms", "cp ring"),
                                ("ep_exposed_comm_ms", "ep"), ("pp_bubble_fraction", "pp bubble"))
            if any(r.get("pred_" + k) is not None for r in planned)]
    lines = ["## The planner's ranking", "", "Nothing was run (`plan=true`): the points ordered by predicted tokens/s.",
             "", "| rank | point | pred tokens/s | pred step ms | pred MFU | pred peak GiB per rank "
             "| pred exposed comm ms" + "".join(f" | {t}" for _, t in axes) + " |", "|---" * (7 + len(axes)) + "|"]
    for i, r in enumerate(planned):
        plan = r.get("plan") or {}
        cells = [str(i + 1), f"{labels[r['job']]} (#{r['job'].split('_', 1)[0]})", _fmt(r["pred_tokens_per_s"]),
                 _fmt(r.get("pred_step_time_ms")), _fmt(plan.get("mfu")), _fmt(r.get("pred_peak_mem_gib")),
                 _fmt(r.get("pred_exposed_comm_ms"))] + [_fmt(r.get("pred_" + k)) for k, _ in axes]
        lines.append("| " + " | ".join(_md_cell(c) for c in cells) + " |")
    return lines + [""]


def write_markdown(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    header, body = table(rows)
    ok = sum(r["status"] == "ok" for r in rows)
    fixed = sorted({f"{k}={v}" for r in rows for k, v in r["swept"].items() if k not in header})
    out = [f"# Sweep report: {title}", "",
           f"{len(rows)} points, {ok} ok, {len(rows) - ok} not ok. `pred` columns are the planner's prediction "
           "(core/planner.py) made before the run." + (f" Every point: `{' '.join(fixed)}`." if fixed else ""), "",
           "| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for line in body:
        out.append("| " + " | ".join(_md_cell(_fmt(v)) for v in line) + " |")
    out += [""] + ranking(rows) + prediction_errors(rows)
    out += ["![throughput vs peak memory](throughput_vs_memory.png)", "",
            "![step time per strategy](step_time_by_strategy.png)", ""]
    path.write_text("\n".join(out))


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    header, body = table(rows)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        for line in body:
            w.writerow(["" if v is None else (";".join(str(x) for x in v) if isinstance(v, list) else v)
                        for v in line])


def point_labels(rows: list[dict[str, Any]]) -> list[str]:
    """Short names for plot legends and axes: the swept values that differ between points (mesh by its preset)."""
    keys = sorted({k for r in rows for k in r["swept"]})
    varying = [k for k in keys if len({r["swept"].get(k) for r in rows}) > 1 and not k.startswith("mesh")]
    meshes = len({r["mesh"] for r in rows}) > 1
    labels = []
    for r in rows:
        parts = ([r["mesh"]] if meshes else []) + [str(r["swept"].get(k, "-")) for k in varying]
        labels.append(" | ".join(parts) or r["job"])
    return labels


def write_plots(rows: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    ok = [r for r in rows if r["status"] == "ok" and r["tokens_per_s"] and r["peak_mem_gib"] is not None]
    # one colour per point, named in a legend beside the axes (labels written next to the points overlap)
    fig, ax = plt.subplots(figsize=(10, 5.5), layout="constrained")
    colours = plt.get_cmap("tab10" if len(ok) <= 10 else "tab20")
    for i, (r, name) in enumerate(zip(ok, point_labels(ok))):
        c = colours(i % colours.N)
        ax.scatter(r["peak_mem_gib"], r["tokens_per_s"], s=50, color=c, label=name)
        if r["pred_peak_mem_gib"] is not None and r["pred_tokens_per_s"]:
            ax.scatter(r["pred_peak_mem_gib"], r["pred_tokens_per_s"], s=50, marker="x", color=c)
            ax.plot([r["peak_mem_gib"], r["pred_peak_mem_gib"]], [r["tokens_per_s"], r["pred_tokens_per_s"]],
                    color=c, lw=0.8, ls=":")
    memory = "peak memory per rank (GiB)" + (": process RSS on the CPU" if any(r.get("device") == "cpu" for r in ok)
                                              else "")
    ax.set_xlabel(memory)
    ax.set_ylabel("tokens / s")
    ax.set_title("Throughput against peak memory\n(o measured, x predicted, dotted: same point)")
    ax.grid(alpha=0.3)
    if ok:
        ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=9, title="point", frameon=False)
    paths.append(out_dir / "throughput_vs_memory.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    timed = [r for r in rows if r["status"] == "ok" and r["step_time_ms"]]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(timed) + 2), 5.5), layout="constrained")
    xs = list(range(len(timed)))
    ax.bar([x - 0.2 for x in xs], [r["step_time_ms"] for r in timed], width=0.4, label="measured")
    ax.bar([x + 0.2 for x in xs], [r["pred_step_time_ms"] or 0 for r in timed], width=0.4, label="predicted",
           color="lightgray", edgecolor="gray")
    ax.set_xticks(xs)
    ax.set_xticklabels([f"{r['mesh']} | {r['strategy']}" for r in timed], rotation=30, ha="right", fontsize=9)
    ax.set_ylabel("step time (ms)")
    ax.set_title("Step time per strategy and mesh")
    ax.legend()
    paths.append(out_dir / "step_time_by_strategy.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def report(sweep_dir: str | Path, quiet: bool = False, rows: Optional[list[dict[str, Any]]] = None) -> dict[str, Path]:
    """Write report.md, report.csv and the plots into `sweep_dir`; return their paths (`rows`: from collect)."""
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise ConfigError("report", f"{sweep_dir} is not a directory", "pass a sweep directory (hydra.sweep.dir)")
    rows = collect(sweep_dir) if rows is None else rows
    if not rows:  # never replace a report (perhaps copied without its job directories) with an empty one
        raise ConfigError("report", f"no sweep points under {sweep_dir} (no job directory with a summary.json)",
                          "pass the directory a multirun wrote (hydra.sweep.dir); nothing there was changed")
    out = {"markdown": sweep_dir / "report.md", "csv": sweep_dir / "report.csv"}
    write_markdown(rows, out["markdown"], sweep_dir.name)
    write_csv(rows, out["csv"])
    try:
        p = write_plots(rows, sweep_dir)
        out["throughput_plot"], out["step_time_plot"] = p
    except ImportError as e:
        print(f"[scalelab] report: no plots ({e}); pip install matplotlib", file=sys.stderr)
    if not quiet:
        print(out["markdown"].read_text())
        print(f"[scalelab] report written to {sweep_dir}", flush=True)
    return out


# A point finished when its run reached the end of its schedule, or the step `train.stop_at_step` asked for;
# a run a signal stopped ("stopped" with its signal named: scancel, Ctrl-C) did not. A plan-only point (plan=true)
# is "planned".
FINISHED = ("ok", "stopped", "planned")


def unfinished_points(rows: list[dict[str, Any]]) -> list[str]:
    """One line per point that did not finish: '<job dir>: <status>[ by <signal>]: <error>'."""
    return [f"{r['job']}: {r['status']}" + (f" by {r['signal']}" if r.get("signal") else "")
            + (f": {r['error']}" if r["error"] else "")
            for r in rows if r["status"] not in FINISHED or r.get("signal")]


class SweepReportCallback(Callback):
    """Hydra callback at the end of a multirun (local or SLURM launcher): write the report, then, if any
    point did not finish (failed, killed, preempted, or still "running" because its job died), list them
    one per line and end the process with exit status 1."""

    def on_multirun_end(self, config, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        if not sweep_dir.is_dir():
            return
        rows = collect(sweep_dir)
        try:
            report(sweep_dir, rows=rows)
        except Exception as e:  # noqa: BLE001 - a report failure must not hide the sweep's results
            print(f"[scalelab] sweep report failed: {type(e).__name__}: {e}", file=sys.stderr)
        failed = unfinished_points(rows)
        if failed:
            print(f"error: {len(failed)} of {len(rows)} sweep points did not finish:", file=sys.stderr)
            for line in failed:
                print(f"  {_one_line(line)}", file=sys.stderr)
            sys.stderr.flush()
            raise SystemExit(1)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    try:
        report(argv[0])
    except ConfigError as e:
        print(f"[scalelab] {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
