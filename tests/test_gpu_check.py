"""``benchmarks/gpu_check.py --smoke``: the GPU check's code runs on CPU with tiny models, so it cannot rot
(its ``e2e`` section, ``benchmarks/gpu_e2e.py``, is tested in ``test_gpu_e2e.py`` too).

Runs the script in a subprocess and reads its JSON report: every section ran or was skipped with a
reason, and every correctness check passed (each compares gradients, weights or RNG states against a
reference; the RNG-replay check also shows that a step without replay would have been caught)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    # lightly goes into a folder under out (pip, no dependencies) or the section is skipped with pip's reason
    p = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--smoke", "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=400,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert (out / "report.md").is_file() and (out / "report.json").is_file()
    return json.loads((out / "report.json").read_text()), (out / "report.md").read_text()


def test_every_section_ran_or_was_skipped_with_a_reason(report):
    data, md = report
    assert data["mode"] == "smoke"
    assert set(data["sections"]) == {
        "correctness", "throughput", "compile", "lightly", "planner_memory", "grad_cache", "e2e"
    }
    for name, sec in data["sections"].items():  # timed_out: a loaded machine; still reported, with its reason
        assert sec["status"] in ("ok", "skipped", "timed_out"), (name, sec)
        assert sec["status"] == "ok" or sec["reason"], name
        assert f"## {name}: {sec['status']}" in md
    assert data["sections"]["correctness"]["status"] == "ok"
    assert data["sections"]["throughput"]["status"] == "ok"
    compiled = data["sections"]["compile"].get("results", {})  # a section can be "ok" with a method that failed
    failed = {name: r["reason"] for name, r in compiled.items() if r["status"] == "failed"}
    assert not failed, failed  # MoCo's split-BN broke inductor before issue 21


def test_e2e_section_reports_the_users_path_against_the_raw_step(report):
    data, md = report
    sec = data["sections"]["e2e"]
    if sec["status"] == "timed_out":  # a loaded machine: reported with its reason, partial results kept
        pytest.skip(sec["reason"])
    assert sec["status"] == "ok", sec.get("reason")
    assert set(sec["results"]) == {"moco", "simclr", "mocov3"}
    ratios = [r["eager"].get("e2e_over_raw") for r in sec["results"].values()]
    assert any(x is not None and x > 0 for x in ratios), sec["results"]
    compiled = sec["results"]["moco"]["compiled"]  # pretrain.py --torch_compile (eager backend on CPU)
    assert compiled.get("e2e_over_raw", 0) > 0 or "no time left" in compiled.get("reason", ""), compiled
    if "e2e" in compiled:
        assert "--torch_compile" in compiled["e2e"]["command"]
    assert "| method | run | e2e images/s | raw images/s | e2e / raw |" in md


def test_correctness_checks_passed(report):
    checks = report[0]["sections"]["correctness"]["checks"]
    assert set(checks) == {"rng_replay", "fp16_scaler_cache", "skipped_step", "sync_batch_norm"}
    for name, c in checks.items():
        assert c["passed"] is True, (name, c)
    replay = checks["rng_replay"]
    assert replay["grad_rel_err"] < replay["tolerance"] < replay["control_without_replay_rel_err"]
    assert checks["skipped_step"]["variants"]["sgd"]["step1_key_encoder_unmoved"] is True
    assert checks["sync_batch_norm"]["equal_without_process_group"] is True


def test_figures_are_consistent(report):
    sections = report[0]["sections"]
    tp = sections["throughput"]
    assert tp["results"]["supervised"]["ratio_to_supervised"] == 1.0
    for r in tp["results"].values():
        assert r["images_per_s"] == pytest.approx(tp["batch"] / r["median_s"], rel=0.01)
    for row in sections["planner_memory"].get("results", []):
        if "measured_mib" in row:
            assert row["measured_over_predicted"] == pytest.approx(
                row["measured_mib"] / row["predicted_mib"], rel=0.02)
    gc = sections["grad_cache"]
    if gc["status"] == "ok":
        cached = next(r for k, r in gc["results"].items() if k.startswith("cached"))
        plain_large = [r for k, r in gc["results"].items() if k.startswith("plain")][1]
        assert cached["negatives"] == plain_large["negatives"]  # same negatives at a chunk's memory


def test_a_failing_or_slow_section_is_reported_and_the_next_still_runs():
    import importlib.util
    import time

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = gpu_check  # dataclasses look their module up
    spec.loader.exec_module(gpu_check)
    settings = gpu_check.Settings.smoke_run()
    settings.budgets = dict(boom=5, slow=1, fine=5, late=5)
    run = gpu_check.Run(settings, total_budget=8)

    def boom(run, record, deadline):
        raise RuntimeError("broken section")

    def slow(run, record, deadline):
        record["partial"] = 1
        time.sleep(3)

    run.section("boom", boom)
    run.section("slow", slow)
    run.section("fine", lambda run, record, deadline: record.update(value=42))
    run.section("late", lambda run, record, deadline: None)
    got = run.sections
    assert got["boom"]["status"] == "failed" and "RuntimeError: broken section" in got["boom"]["reason"]
    assert got["slow"]["status"] == "timed_out" and got["slow"]["partial"] == 1  # partial results kept
    assert got["slow"]["seconds"] < 2.5
    assert got["fine"]["status"] == "ok" and got["fine"]["value"] == 42
    assert got["late"]["status"] in ("ok", "skipped")  # within or past the 8 s total budget
    assert got["late"]["status"] == "ok" or "no time left" in got["late"]["reason"]
