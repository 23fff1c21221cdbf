"""Mutation pass of the guard's environment check (``ModelSpec.check_environment``: core's guard.py and spec.py,
nvidia_mega's specs.py, and what its check says: build.check_switches, env_config.py, pdl.py): break it in one
place, run core/tests/test_plugin_guard.py and vendors/nvidia_mega/tests/test_switch_guard.py, expect a failure.

    TRITON_INTERPRET=1 .venv/bin/python bench/scripts/mutate_guard_env.py   # from the repository root

Prints CAUGHT (with the first failing test) or MISSED per mutation; exits 1 if any was missed.
"""

import os
import pathlib
import sys

import mutation_runner  # same directory

G = pathlib.Path("core/src/lowlat/runtime/plugin_host/guard.py")
S = pathlib.Path("core/src/lowlat/plugin/spec.py")
V = pathlib.Path("vendors/nvidia_mega/src/lowlat_nvidia_mega/specs.py")
B = pathlib.Path("vendors/nvidia_mega/src/lowlat_nvidia_mega/build.py")
P = pathlib.Path("vendors/nvidia_mega/src/lowlat_nvidia_mega/kernels/pdl.py")
C = pathlib.Path("vendors/nvidia_mega/src/lowlat_nvidia_mega/kernels/env_config.py")
M = [  # (name, file, original text, mutated text)
    ("the check never runs", G, "    if spec.check_environment is not None:\n", "    if False:\n"),
    ("run without its libraries", G, "    if not libraries_ok:\n", "    if False:\n"),
    ("skipped with its libraries", G, "    if not libraries_ok:\n", "    if libraries_ok:\n"),
    ("a refusal passes", G, 'RequirementResult("environment", FAIL, f"{type(e).__name__}: {e}")',
     'RequirementResult("environment", PASS, f"{type(e).__name__}: {e}")'),
    ("the message dropped", G, 'RequirementResult("environment", FAIL, f"{type(e).__name__}: {e}")',
     'RequirementResult("environment", FAIL, f"{type(e).__name__}")'),
    ("only ValueError caught", G, "    except BaseException as e:  # noqa: BLE001",
     "    except ValueError as e:  # noqa"),
    ("the path not validated", S, '("build", "check_model", "check_environment")', '("build", "check_model")'),
    ("nvidia_mega's specs without it", V, "tp_sizes=TP_SIZES), **_CHECK_ENV)", "tp_sizes=TP_SIZES))"),
    # what nvidia_mega's check says (build.check_switches, env_config, pdl)
    ("PDL not checked", B, "for switch in (pdl_enabled, ", "for switch in ("),
    ("PDL lenient again", P, 'if not env_switch(ENV_SWITCH, True, "PDL where the GPU supports it"):',
     'if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "off", "no"):'),
    ("the shared prefix matched", B, "difflib.get_close_matches(k[len(PREFIX):], by_stem, n=1)",
     "difflib.get_close_matches(k, by_stem, n=1)"),
    ("no closest field", C, 'hint = f" (did you mean {close[0]}?)" if close else ""', 'hint = ""'),
    ("long numbers called not integers", C, 'if re.fullmatch(r"-?[0-9]{19,}", value):', "if False:"),
    ("no hint at ';'", C, "sep = \"; separate items with ',' not ';'\" if \";\" in value else \"\"", 'sep = ""'),
]

if __name__ == "__main__":
    sys.exit(mutation_runner.run(
        M, "core/tests/test_plugin_guard.py", {**os.environ, "TRITON_INTERPRET": "1"},
        pytest_args=("vendors/nvidia_mega/tests/test_switch_guard.py",)))
