"""bench/gpu_jobs.py: every job's steps name files that exist and lowlat commands that parse."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def jobs():
    spec = importlib.util.spec_from_file_location("gpu_jobs", ROOT / "bench" / "gpu_jobs.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_jobs"] = mod
    spec.loader.exec_module(mod)
    yield mod
    del sys.modules["gpu_jobs"]


def _steps(jobs):
    opts = jobs.Options(jobs.DEFAULT_MODELS.split(","), jobs.DEFAULT_PLUGINS.split(","), 1.0)
    return [(name, s) for name, make in jobs.JOBS.items() for s in make(opts)]


def test_every_job_has_steps_with_unique_output_files(jobs):
    steps = _steps(jobs)
    assert {name for name, _ in steps} == set(jobs.JOBS)
    outs = [s.out for _, s in steps]
    assert len(outs) == len(set(outs)), "two steps write the same output file"


def test_scripts_the_steps_run_exist(jobs):
    for _, s in _steps(jobs):
        for a in s.argv[1:2]:
            if a.endswith(".py"):
                assert (ROOT / a).is_file(), f"{s.name}: {a} does not exist"


def test_lowlat_commands_parse(jobs):
    from lowlat.cli import build_parser

    parser = build_parser()
    for _, s in _steps(jobs):
        if s.argv[1:3] == ["-m", "lowlat.cli"]:
            parser.parse_args(s.argv[3:])  # SystemExit on an unknown flag


def test_unknown_job_is_an_error_naming_the_jobs(jobs, capsys):
    with pytest.raises(SystemExit):
        jobs.main(["no-such-job"])
    assert "smoke" in capsys.readouterr().err
