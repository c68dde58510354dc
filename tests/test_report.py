"""The sweep report on a stand-in sweep directory: rows, swept keys, predictions, failures, files."""
from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from experiments.report import SweepReportCallback, collect, mesh_name, point_labels, report
from tests.utils import train_py

ROOT = Path(__file__).resolve().parents[1]


def _job(root: Path, name: str, overrides: list[str], **summary) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 5.0}) + "\n")
    (d / "summary.json").write_text(json.dumps({"overrides": overrides, **summary}))
    return d


@pytest.fixture()
def sweep(tmp_path: Path) -> Path:
    plan = {"step_time_ms": 100.0, "tokens_per_s": 20000.0, "peak_mem_gib": 10.0, "exposed_comm_ms": 5.0}
    _job(tmp_path, "0_mesh=dp1,parallelism=ddp_bucketed", ["mesh=dp1", "parallelism=ddp_bucketed"], status="ok",
         error=None, parallelism="ddp_bucketed", mesh="single", tokens_per_s=18000.0, mfu=0.31, step_time_ms=110.0,
         peak_mem_gib=11.0, peak_mem_gib_per_rank=[11.0], exposed_comm_ms=0.0, final_loss=3.5, plan=plan)
    _job(tmp_path, "1_mesh=dp2,parallelism=fsdp", ["mesh=dp2", "parallelism=fsdp"], status="ok", error=None,
         parallelism="fsdp", mesh="dp_shard2", tokens_per_s=30000.0, mfu=0.27, step_time_ms=130.0,
         peak_mem_gib=6.5, peak_mem_gib_per_rank=[6.5, 6.4], exposed_comm_ms=12.0, final_loss=3.4,
         plan={**plan, "peak_mem_gib": 6.0})
    _job(tmp_path, "10_mesh=dp2,parallelism=zero1", ["mesh=dp2", "parallelism=zero1"], status="failed",
         error="RuntimeError: boom | with a pipe")
    return tmp_path


def test_rows_follow_job_numbers_and_carry_swept_keys(sweep: Path):
    rows = collect(sweep)
    assert [r["job"].split("_")[0] for r in rows] == ["0", "1", "10"]
    assert rows[1]["swept"] == {"mesh": "dp2", "parallelism": "fsdp"}
    assert rows[1]["pred_peak_mem_gib"] == 6.0 and rows[1]["peak_mem_gib_per_rank"] == [6.5, 6.4]
    assert rows[2]["status"] == "failed" and "boom" in rows[2]["error"]
    # meshes by the preset the user typed, not the run's internal name ("single", "dp_shard2")
    assert [r["mesh"] for r in rows] == ["dp1", "dp2", "dp2"]


def test_mesh_names_follow_what_was_typed():
    assert mesh_name({"mesh": "dp2", "mesh.dp_replicate": "2", "mesh.device": "cpu"}, "x") == "dp2 dp_replicate=2"
    assert mesh_name({"parallelism": "fsdp"}, "dp4") == "dp4" and mesh_name({}, None) == "?"
    rows = [{"job": "0", "mesh": m, "swept": {"mesh": m, "parallelism": p, "seed": "1"}}
            for m, p in (("dp1", "fsdp"), ("dp2", "fsdp"), ("dp2", "zero1"))]
    assert point_labels(rows) == ["dp1 | fsdp", "dp2 | fsdp", "dp2 | zero1"]  # only what differs between points


def test_cpu_points_compare_no_memory(tmp_path: Path):
    """On the CPU the measured peak is process RSS: the report compares step time but not memory."""
    _job(tmp_path, "0_mesh=dp1", ["mesh=dp1"], status="ok", error=None, parallelism="none", mesh="dp1", device="cpu",
         tokens_per_s=100.0, step_time_ms=200.0, peak_mem_gib=0.8, final_loss=5.0,
         plan={"step_time_ms": 300.0, "tokens_per_s": 70.0, "peak_mem_gib": 0.05})
    section = report(tmp_path, quiet=True)["markdown"].read_text().split("## Prediction against measurement")[1]
    assert "| 0_mesh=dp1 | 300.00 / 200.00 | +50% | 0.050 / 0.800 | - |" in section
    assert "not compared on the CPU" in section


def test_markdown_csv_and_plots(sweep: Path):
    out = report(sweep, quiet=True)
    md = out["markdown"].read_text()
    first_table = md.split("## Ranking")[0]
    assert first_table.count("\n| ") == 4  # header + 3 points
    assert "| 1_mesh=dp2,parallelism=fsdp | ok | dp2 | fsdp |" in md
    assert "boom \\| with a pipe" in md
    with out["csv"].open() as f:
        table = list(csv.DictReader(f))
    assert [r["parallelism"] for r in table] == ["ddp_bucketed", "fsdp", "zero1"]
    assert float(table[1]["tokens/s"]) == 30000.0 and float(table[1]["pred peak GiB"]) == 6.0
    assert table[1]["peak GiB per rank"] == "6.5;6.4" and table[2]["status"] == "failed"
    for key in ("throughput_plot", "step_time_plot"):
        assert out[key].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_prediction_errors_and_tolerance_counts(sweep: Path):
    md = report(sweep, quiet=True)["markdown"].read_text()
    section = md.split("## Prediction against measurement")[1]
    # (pred - measured) / measured: step 100 vs 110 -> -9%, 100 vs 130 -> -23%; peak 10 vs 11 -> -9%, 6 vs 6.5 -> -8%
    assert "| 0_mesh=dp1,parallelism=ddp_bucketed | 100.00 / 110.00 | -9% | 10.00 / 11.00 | -9% |" in section
    assert "| 1_mesh=dp2,parallelism=fsdp | 100.00 / 130.00 | -23% | 6.00 / 6.50 | -8% |" in section
    assert "10_mesh=dp2" not in section  # failed points have no measurement to compare
    assert "Step time within 25%: 2 of 2 points. Peak memory within 10%: 2 of 2 points." in section


def test_ranking_orders_points_by_measured_throughput_beside_the_planners_order(tmp_path: Path):
    """Three points whose measured order (c, a, b) differs from the predicted one (a, c, b): the table lists them
    fastest first with the planner's rank, and says the planner's best three are not in the measured order."""
    points = (("0_mesh=a", 100.0, 300.0), ("1_mesh=b", 50.0, 100.0), ("2_mesh=c", 200.0, 200.0))
    for name, measured, predicted in points:
        _job(tmp_path, name, [f"mesh={name[-1]}"], status="ok", error=None, tokens_per_s=measured,
             step_time_ms=1e5 / measured, plan={"tokens_per_s": predicted})
    _job(tmp_path, "3_mesh=d", ["mesh=d"], status="failed", error="refused")
    text = report(tmp_path, quiet=True)["markdown"].read_text()
    section = text.split("## Ranking", 1)[1].split("##", 1)[0]
    rows = [line.split(" | ") for line in section.splitlines() if line.startswith("| ") and line[2].isdigit()]
    ranked = [(r[0].strip("| "), r[1].split()[0], r[5]) for r in rows]
    assert ranked == [("1", "c", "2"), ("2", "a", "1"), ("3", "b", "3")]
    assert "best 3 in the measured order: no" in section and "| d" not in section


def test_a_plan_only_sweep_is_ranked_by_the_prediction_and_counts_as_finished(tmp_path: Path):
    for name, predicted in (("0_mesh=a", 100.0), ("1_mesh=b", 300.0), ("2_mesh=c", 200.0)):
        _job(tmp_path, name, [f"mesh={name[-1]}"], status="planned", plan={"tokens_per_s": predicted, "mfu": 0.4,
                                                                            "tp_exposed_comm_ms": 1.0})
    rows = collect(tmp_path)
    text = report(tmp_path, quiet=True, rows=rows)["markdown"].read_text()
    section = text.split("## The planner's ranking", 1)[1].split("##", 1)[0]
    ranked = [line.split(" | ")[1].split()[0] for line in section.splitlines()
              if line.startswith("| ") and line[2].isdigit()]
    assert ranked == ["b", "c", "a"] and "| tp |" in section
    SweepReportCallback().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}}))  # no exit 1


def test_a_directory_without_points_keeps_its_report(tmp_path: Path):
    """A report copied without its job directories is not overwritten by an empty one; one clear error."""
    (tmp_path / "report.md").write_text("the real report")
    proc = subprocess.run([sys.executable, "-m", "experiments.report", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "no sweep points" in proc.stderr and "Traceback" not in proc.stderr
    assert (tmp_path / "report.md").read_text() == "the real report"


def test_prediction_recomputed_from_the_saved_config(tmp_path: Path):
    """A run that logged no plan still gets one, from its .hydra/config.yaml."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["model=tiny", "++planner.device=cpu"])
    d = _job(tmp_path, "0_model=tiny", ["model=tiny"], status="ok", error=None, tokens_per_s=1.0, step_time_ms=1.0,
             peak_mem_gib=0.0)
    (d / ".hydra").mkdir()
    (d / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    rows = collect(tmp_path)
    from hydra.utils import instantiate

    from core.planner import plan

    assert rows[0]["plan"]["params"] == instantiate(cfg.model).num_params()
    assert rows[0]["pred_step_time_ms"] == pytest.approx(plan(cfg).step_time_ms)


def test_command_line(sweep: Path):
    r = subprocess.run([sys.executable, "-m", "experiments.report", str(sweep)], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert (sweep / "report.md").is_file() and "Sweep report" in r.stdout


def test_a_sweep_with_unfinished_points_ends_with_status_1_listing_them(sweep: Path, capsys):
    _job(sweep, "2_mesh=dp2,parallelism=fsdp2", ["mesh=dp2"], status="running")  # its job died without a word
    _job(sweep, "3_mesh=dp2,parallelism=ddp_flat", ["mesh=dp2"], status="stopped", error=None)  # train.stop_at_step
    _job(sweep, "4_mesh=dp2,parallelism=ddp_bucketed", ["mesh=dp2"], status="stopped", error=None,
         signal="SIGTERM")  # scancel or Ctrl-C: checkpointed, but its schedule did not end
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}})
    with pytest.raises(SystemExit) as e:
        SweepReportCallback().on_multirun_end(config=config)
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert "error: 3 of 6 sweep points did not finish:" in err
    failed = [line.strip() for line in err.splitlines() if line.startswith("  ")]
    assert failed == ["2_mesh=dp2,parallelism=fsdp2: running",
                      "4_mesh=dp2,parallelism=ddp_bucketed: stopped by SIGTERM",
                      "10_mesh=dp2,parallelism=zero1: failed: RuntimeError: boom | with a pipe"]
    assert (sweep / "report.md").is_file()  # the report is written first


def test_a_sweep_whose_points_all_finished_ends_normally(sweep: Path):
    (sweep / "10_mesh=dp2,parallelism=zero1" / "summary.json").write_text(json.dumps({"status": "ok"}))
    SweepReportCallback().on_multirun_end(config=OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}}))
    assert (sweep / "report.md").is_file()


@pytest.mark.slow
def test_a_local_sweep_with_a_failed_point_exits_non_zero(tmp_path: Path):
    """The callback's exit status is the process's: Hydra does not swallow it (before: exit 0)."""
    r = train_py(["-m", "model=tiny", "train.max_steps=4", "train.log_every=1", "train.eval_every=0",
                  "train.eval_batches=1", "optimizer.warmup_steps=0", "optimizer.lr=1e30",
                  f"hydra.sweep.dir={tmp_path / 'sweep'}"], timeout=600)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    assert "error: 1 of 1 sweep points did not finish:" in r.stderr
    failed = r.stderr.split("error: 1 of 1 sweep points did not finish:\n")[1].splitlines()
    assert len(failed) == 1 and failed[0].startswith("  0_") and "optimizer.lr=1e+30" in failed[0], r.stderr[-2000:]
    assert "failed: " in failed[0] and "the loss became nan" in failed[0], r.stderr[-2000:]
    assert (tmp_path / "sweep" / "report.md").is_file()


def test_validated_sweeper_lists_every_invalid_point_before_starting(tmp_path: Path):
    """No CUDA here: every mesh.device=cuda point is invalid, and the odd batch fails its own check."""
    r = train_py(["-m", "hydra/sweeper=validated", "model=tiny", "parallelism=ddp_bucketed", "mesh=dp1,dp2",
                  "mesh.device=cuda,cpu", "train.batch_size=16,15", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                 timeout=120)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    # 4 cuda points + the dp2 point whose 15 sequences do not split over 2 ranks
    assert "5 of 8 sweep points cannot run; nothing was started" in r.stderr
    assert r.stderr.count("mesh.device=cuda") == 4 and "CUDA" in r.stderr
    assert not list((tmp_path / "sweep").glob("*/summary.json"))


@pytest.mark.parametrize("world,per_node,gpus,expected", [
    (1, 8, True, {"tasks_per_node": 1, "nodes": 1, "gpus_per_node": 1}),
    (2, 8, True, {"tasks_per_node": 2, "nodes": 1, "gpus_per_node": 2}),
    (16, 8, True, {"tasks_per_node": 8, "nodes": 2, "gpus_per_node": 8}),
    (12, 8, True, {"tasks_per_node": 6, "nodes": 2, "gpus_per_node": 6}),
    (2, 2, False, {"tasks_per_node": 2, "nodes": 1}),
])
def test_slurm_resources_follow_each_points_mesh(world, per_node, gpus, expected):
    from launchers.slurm import ScalelabSlurmLauncher

    launcher = ScalelabSlurmLauncher(ranks_per_node=per_node, gpus=gpus, submitit_folder="x", timeout_min=1)
    assert launcher._resources(world, None) == expected


def test_slurm_refuses_a_world_that_does_not_split_over_nodes():
    from core.errors import ConfigError
    from launchers.slurm import ScalelabSlurmLauncher

    with pytest.raises(ConfigError, match="9 ranks do not split evenly over 2 nodes"):
        ScalelabSlurmLauncher(ranks_per_node=8, gpus=True, submitit_folder="x")._resources(9, None)
