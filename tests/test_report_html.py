"""``python -m mpilearn.report RUN`` writes RUN/index.html, one self-contained page; opened in a
real headless browser (Debian's chromium through its chromedriver, driven by selenium: no
browser download) it renders, every image loads, and the console has no error. On a toy run
(with a membership change, a restart and noise-scale records) and on the demo's 3DGAN run."""
import json
import os
import shutil

import pytest

from conftest import mpirun

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")


@pytest.fixture(scope="module")
def browser():
    webdriver = pytest.importorskip("selenium.webdriver",
                                    reason="selenium is not installed (the test extra: make setup)")
    if not (CHROMIUM and DRIVER):
        pytest.skip("*** no chromium/chromedriver: `make test` installs them as root "
                    "(apt-get install chromium chromium-driver); the report page's browser test "
                    "is SKIPPED ***")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--allow-file-access-from-files", "--window-size=1400,1000"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(DRIVER))
    yield driver
    driver.quit()


def open_page(driver, path):
    """Loads the page; returns its text. Asserts every image loaded and the console is clean."""
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get("file://" + os.path.abspath(path))
    # its images may still be decoding when get() returns on a busy machine
    WebDriverWait(driver, 30).until(
        lambda d: d.execute_script("return document.readyState") == "complete")
    images = driver.execute_script(
        "return Array.from(document.images).map(i => [i.getAttribute('src'), i.complete, "
        "i.naturalWidth])")
    assert images, "the page shows no image"
    broken = [src for src, complete, width in images if not (complete and width > 0)]
    assert not broken, f"images that did not load: {broken}"
    errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, f"console errors: {errors}"
    return driver.find_element("tag name", "body").text, images


def test_a_toy_runs_page_shows_its_config_plots_cost_restarts_and_noise_scale(browser, toy_file,
                                                                              tmp_path):
    run = tmp_path / "run"
    args = ["-m", "mpilearn.train", "--no-progress", "--set", "model=models/mlp.py",
            "--set", f"data.files=[{toy_file}]", "--set", "train.epochs=1",
            "--output", str(run)]
    assert mpirun(1, args).returncode == 0
    resumed = mpirun(1, args[:-2] + ["--set", "train.epochs=2", "--output", str(run), "--resume"])
    assert resumed.returncode == 0, resumed.stderr
    # what an elastic run and the noise-scale measurement add to metrics.jsonl (their own
    # tests make them for real): the page shows whatever keys they carry
    lines = [json.loads(line) for line in open(run / "metrics.jsonl")]
    for r in lines:
        if "time" in r:
            r["noise_scale"] = {"opt": {"b_simple": 120.5, "b_simple_err": 10.0, "b_pre": None,
                                        "b_pre_err": None, "critical_batch": 120.5,
                                        "efficiency": 0.8, "global_batch": 32, "steps": 29,
                                        "a_new_key": 1}}
    lines.insert(1, {"epoch": 2, "step": 30, "membership": {
        "lost_ranks": [1], "lost_hosts": ["node7"], "old_size": 2, "ranks": 1,
        "leader_lost": False, "recovery_s": 0.25, "detected_at": 1.0}})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    proc = mpirun(1, ["-m", "mpilearn.report", str(run)])
    assert proc.returncode == 0, proc.stderr
    assert f"page: {run / 'index.html'}" in proc.stdout
    text, images = open_page(browser, run / "index.html")
    assert {src for src, _, _ in images} >= {"report/losses.png", "report/cost.png",
                                             "report/throughput.png", "report/noise_scale.png"}
    for expected in ("Physics against the MC-vs-MC floor", "No physics numbers",
                     "2 launch(es): 1 restart(s)", "1 membership change(s)", "ranks 2 -> 1",
                     "epoch 2, step 30: lost rank 1 on node7; 2 -> 1 ranks, recovered in 0.25 s",
                     "b_simple", "a_new_key", "critical_batch", "model: models/mlp.py",
                     "cost: launched"):
        assert expected in text, expected


def test_the_demo_3dgan_runs_page_shows_physics_against_floors_and_every_plot(browser, tmp_path):
    run = tmp_path / "demo"
    proc = mpirun(1, ["-m", "mpilearn.train", "--no-progress", "--demo", "--output", str(run),
                      "--set", "train.epochs=1", "--set", "train.max_steps_per_epoch=1",
                      "--set", "train.physics_events=32"], timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = mpirun(1, ["-m", "mpilearn.report", str(run)])
    assert proc.returncode == 0, proc.stderr
    text, images = open_page(browser, run / "index.html")
    srcs = {src for src, _, _ in images}
    assert "report/physics.png" in srcs
    plots = {os.path.relpath(p, run) for p in map(str, run.glob("validation/*/*.png"))}
    assert plots and plots <= srcs, plots - srcs
    for expected in ("MC-vs-MC floor", "score", "fpd", "x the MC floor", "Gradient noise scale",
                     "Published reference points", "Geant4 against itself", "CaloDREAM"):
        assert expected in text, expected
    assert any(" σ" in line and line.startswith("fpd") for line in text.splitlines()), text


def test_a_sweeps_page_shows_its_trials_and_plots(browser, tmp_path):
    """A sweep of a Python objective (no training: the page is what is tested)."""
    import yaml

    from conftest import TESTS

    cfg = tmp_path / "hpo.yaml"
    cfg.write_text(yaml.safe_dump({"output": str(tmp_path / "sweep"), "search": {
        "searcher": "random", "budget": 6, "blocks": 2, "folds": 1,
        "objective": {"function": "objectives:slow_quadratic"},
        "space": {"x": {"type": "real", "low": 0.0, "high": 1.0}}}}))
    proc = mpirun(3, ["-m", "mpilearn.optimize", "--config", str(cfg), "--no-progress"],
                  env={"PYTHONPATH": TESTS})
    assert proc.returncode == 0, proc.stderr
    proc = mpirun(1, ["-m", "mpilearn.report", str(tmp_path / "sweep")])
    assert proc.returncode == 0, proc.stderr
    text, images = open_page(browser, tmp_path / "sweep" / "index.html")
    assert {"report/convergence.png", "report/parameters.png"} <= {s for s, _, _ in images}
    assert "best " in text and "Trials" in text and text.count("done") >= 6
