"""bench/scripts/plan_ab.py (the B side of a plan-table A/B): it refuses a replacement no lookup would read, or a
command whose work never sees it, and otherwise sets the entry for this GPU's names before the lowlat command runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from lowlat_nvidia_mega.kernels import tuned_plans

SCRIPTS = Path(__file__).resolve().parents[3] / "bench" / "scripts"
if not (SCRIPTS / "plan_ab.py").is_file():
    pytest.skip("bench/scripts/plan_ab.py is not in this checkout", allow_module_level=True)
sys.path.insert(0, str(SCRIPTS))
import plan_ab  # noqa: E402

GOOD = ["--table", "TUNED_ROW1", "--key", "qkv,3072,2048,bfloat16", "--value", "8,1024,4,3", "--"]


@pytest.mark.parametrize("argv,match", [
    (["--table", "TUNED_ROW1", "--key", "qkv,3072,2048,bf16", "--value", "8,1024,4,3", "--", "plugins"], "never read"),
    (["--table", "TUNED_ROW1", "--key", "qvk,3072,2048,bfloat16", "--value", "8,1024,4,3", "--", "plugins"],
     "never read"),
    (["--table", "TUNED", "--key", "qkv_late,3072,2048,bfloat16", "--value", "64,256,4,4,3", "--", "plugins"],
     "never read"),
    (["--table", "TUNED_ROW1", "--key", "qkv,-3072,2048,bfloat16", "--value", "8,1024,4,3", "--", "plugins"],
     "never read"),
    (["--table", "TUNED_ROW1", "--key", "qkv,3072,2048,bfloat16", "--value", "8,2048", "--", "plugins"],
     "not a TUNED_ROW1 plan"),
    (["--table", "TUNED_ROW1", "--key", "qkv,3072,2048,bfloat16", "--value", "6,1024,4,3", "--", "plugins"],
     "not a TUNED_ROW1 plan"),
    (["--table", "TUNED", "--key", "qkv,3072,2048,bfloat16", "--value", "8", "--", "plugins"], "not a TUNED plan"),
    (["--table", "TUNED_ROW1", "--key", "qkv,3072", "--value", "8,1024,4,3", "--", "plugins"], "kind,N,K,dtype"),
    (["--table", "TUNED_ROW1", "--key", "qkv,3072,2048,half", "--value", "8,1024,4,3", "--", "plugins"], "never read"),
    (["--table", "TUNED_ROW1", "--key", "qkv,3072,2048,bfloat16", "--value", "None", "--", "plugins"], "'none'"),
    (["--table", "TUNED_ROW1", "--key", "qkv,9999,2048,bfloat16", "--value", "none", "--", "plugins"],
     "no entry .* to remove"),
    ([*GOOD, "bench", "serve"], "other processes"),
    ([*GOOD, "serve"], "other processes"),
    ([*GOOD, "run", "--tp", "2"], "other processes"),
    ([*GOOD, "run", "--tp=4"], "other processes"),
    (["--table", "TUNED_ROW1", "--key", "gemm,2048,2048,bfloat16", "--key", "gated,8192,2048,bfloat16",
      "--value", "8,2048,8,1", "--", "plugins"], "one --value per --key"),
    (["--table", "TUNED_ROW1", "--key", "gemm,2048,2048,bfloat16", "--value", "8,2048,8,1", "--key",
      "gated,8192,2048,bfloat16", "--value", "2,2048,4,1,1,-1", "--", "plugins"], "not a TUNED_ROW1 plan"),
    (["--table", "TUNED_ROW1", "--key", "qkv,3072,2048,bfloat16", "--value", "8,1024,4,3,1,2", "--", "plugins"],
     "no weight-stream form"),
    (["--table", "TUNED_ROW1", "--key", "gemm,2048,2048,bfloat16", "--value", "8,2048,8,1", "--key",
      "gemm,2048,02048,bfloat16", "--value", "none", "--", "plugins"], "named already"),
    (["--table", "TUNED_ROW1", "--key", "gemm,2048,2048,bfloat16", "--value", "8,2048,8,1,1,2,0", "--", "plugins"],
     "has 7 fields"),
])
def test_refuses_a_replacement_that_would_not_count(argv: list[str], match: str) -> None:
    with pytest.raises(SystemExit, match=match):
        plan_ab.main(argv)


def test_refuses_with_the_tables_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(tuned_plans.TUNED_ENV, "0")
    with pytest.raises(SystemExit, match="B would run as A"):
        plan_ab.main([*GOOD, "plugins"])
    monkeypatch.setenv(tuned_plans.TUNED_ENV, "bogus")  # a value that does not parse: a message, no traceback
    with pytest.raises(SystemExit, match="LOWLAT_MEGA_TUNED='bogus'"):
        plan_ab.main([*GOOD, "plugins"])


def test_help_and_a_missing_command() -> None:
    with pytest.raises(SystemExit) as e:
        plan_ab.main(["--help"])
    assert e.value.code == 0
    with pytest.raises(SystemExit):
        plan_ab.main(GOOD[:-1])


def test_sets_the_entry_for_this_gpus_names_before_the_command(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}

    def fake_cli(rest: list[str]) -> int:
        seen["rest"] = rest
        seen["entry"] = tuned_plans.TUNED_ROW1.get(("cpu", "qkv", 3072, 2048, "bfloat16"))
        return 3

    import lowlat.cli
    monkeypatch.setattr(lowlat.cli, "main", fake_cli)
    monkeypatch.setattr(tuned_plans, "TUNED_ROW1", dict(tuned_plans.TUNED_ROW1))  # restored after the test
    assert plan_ab.main([*GOOD, "bench", "--model", "llama-3.2-1b"]) == 3
    assert seen == {"rest": ["bench", "--model", "llama-3.2-1b"], "entry": (8, 1024, 4, 3)}


def test_value_none_removes_the_entry_for_this_gpus_names(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}
    key = ("cpu", "qkv_late", 6144, 4096, "bfloat16")

    def fake_cli(rest: list[str]) -> int:
        seen["present"] = key in tuned_plans.TUNED_ROW1
        return 0

    import lowlat.cli
    monkeypatch.setattr(lowlat.cli, "main", fake_cli)
    monkeypatch.setattr(tuned_plans, "TUNED_ROW1", {**tuned_plans.TUNED_ROW1, key: (8, 1024, 4, 3)})
    assert plan_ab.main(["--table", "TUNED_ROW1", "--key", "qkv_late,6144,4096,bfloat16", "--value", "none", "--",
                         "plugins"]) == 0
    assert seen == {"present": False}


def test_repeated_keys_set_every_entry_before_the_command(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--key`` / ``--value`` pairs in order: each entry is set (a weight-stream plan too) before the command runs,
    and a bad second pair refuses the whole replacement (the test above)."""
    seen = {}
    keys = [("cpu", "gemm", 2048, 2048, "bfloat16"), ("cpu", "gated", 8192, 2048, "bfloat16")]

    def fake_cli(rest: list[str]) -> int:
        seen["entries"] = [tuned_plans.TUNED_ROW1.get(k) for k in keys]
        return 0

    import lowlat.cli
    monkeypatch.setattr(lowlat.cli, "main", fake_cli)
    monkeypatch.setattr(tuned_plans, "TUNED_ROW1", dict(tuned_plans.TUNED_ROW1))
    assert plan_ab.main(["--table", "TUNED_ROW1", "--key", "gemm,2048,2048,bfloat16", "--value", "8,2048,8,1", "--key",
                         "gated,8192,2048,bfloat16", "--value", "2,2048,4,1,1,4", "--", "plugins"]) == 0
    assert seen == {"entries": [(8, 2048, 8, 1), (2, 2048, 4, 1, 1, 4)]}
