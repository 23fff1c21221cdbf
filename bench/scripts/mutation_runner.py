"""The loop of a source-mutation pass: apply one mutation, run a test file, expect a failure, restore the source.

Used by ``mutate_peer_allreduce.py``, ``mutate_amd_counters.py``, ``mutate_amd_step.py``, ``mutate_amd_row1.py``,
``mutate_mega_gemv.py``, ``mutate_mega_prenorm.py``, ``mutate_mega_moe.py``, ``mutate_mega_attn.py`` and
``mutate_fused_kernels.py`` (run from the repository root).
"""

import pathlib
import subprocess
import sys

Mutation = tuple[str, pathlib.Path, str, str]  # (name, file, original text, mutated text)


def run(mutations: list[Mutation], test_file: str, env: dict[str, str], timeout_s: int = 300,
        pytest_args: tuple[str, ...] = ()) -> int:
    """Apply each mutation alone (its original text must occur exactly once), run ``pytest -x test_file`` under
    ``env`` (a hang counts as caught after ``timeout_s``; ``pytest_args`` go before the file, e.g. ``("-k", ...)``),
    restore the file, and print CAUGHT (with the first failing test) or MISSED. Returns the process exit status: 1 if
    any mutation was missed, else 0."""
    missed = 0
    for name, p, old, new in mutations:
        src = p.read_text()
        assert src.count(old) == 1, (name, src.count(old), old)
        p.write_text(src.replace(old, new))
        try:
            try:
                r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-rf",
                                    *pytest_args, test_file], capture_output=True, text=True, env=env,
                               timeout=timeout_s)
                lines = r.stdout.strip().splitlines() or ["(no output)"]
                first = next((ln.split("::")[1].split(" ")[0] for ln in lines if ln.startswith("FAILED ")), "")
                rc, last = r.returncode, f"{first}: {lines[-1]}"
            except subprocess.TimeoutExpired:
                rc, last = 124, f"hung: killed after {timeout_s} s"
            missed += rc == 0
            print(("CAUGHT " if rc else "MISSED ") + name + " -> " + last, flush=True)
        finally:
            p.write_text(src)
    return 1 if missed else 0
