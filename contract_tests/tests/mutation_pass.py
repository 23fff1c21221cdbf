# ruff: noqa: E501  (the mutations are source lines, quoted whole)
"""Mutation pass on the suite's checkers (not collected by pytest: run ``python contract_tests/tests/mutation_pass.py``
from the repository root). Each mutation weakens one check of oracle.py, cases.py, router_ties.py or sweep.py;
the checker tests must then fail ("killed"). Sources are restored after each run."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1] / "src" / "lowlat_contract"
REPO = pathlib.Path(__file__).resolve().parents[2]
MUTATIONS = [
    ("oracle.py", "    outside[loc] = False\n", "    pass\n"),
    ("oracle.py", ".view(torch.uint8) != old.view(old.shape[0], -1).view(torch.uint8))", ") != old.view(old.shape[0], -1))"),
    ("oracle.py", "    if not torch.equal(pool.req_to_token, snap[-1]):", "    if False:"),
    ("oracle.py", "    out = [n for n in BATCH_TENSORS if not torch.equal(getattr(batch, n), getattr(pristine, n))]", "    out = []"),
    ("oracle.py", 'kw = {n: getattr(batch, n).clone() for n in BATCH_TENSORS}', 'kw = {n: getattr(batch, n) for n in BATCH_TENSORS}'),
    ("cases.py", "        over = (row_max > self.max_rel * scale) | (row_mean > self.mean_rel * scale)", "        over = row_max > self.max_rel * scale"),
    ("cases.py", "        scale = w.abs().reshape(rows, -1).amax(dim=1).clamp_min(1.0)", "        scale = w.abs().amax().clamp_min(1.0).expand(rows)"),
    ("cases.py", "        if self.low_precision and tie_rows:", "        if tie_rows:"),
    ("cases.py", "        return cls(dtype, r * u, math.sqrt(r) * u, True)", "        return cls(dtype, r * u, math.sqrt(r) * u * 2, True)"),
    ("router_ties.py", "        gs, ps = g.sort(dim=-1).values, p.sort(dim=-1).values", "        gs, ps = g, p"),
    ("sweep.py", "    return sorted({1, min(2, m), m - 1 if m > 1 else 1, m,", "    return sorted({1, min(2, m), m - 1 if m > 1 else 1,"),
    ("sweep.py", "        for i in range(0, len(left), big_b):", "        for i in range(0, 0, big_b):"),
    ("sweep.py", "    if decode and m + 1 <= max_batch:", "    if False:"),
]
tests = ["contract_tests/tests/test_oracle_checks.py", "contract_tests/tests/test_tolerance.py",
         "contract_tests/tests/test_sweep_plan.py", "contract_tests/tests/test_router_ties.py"]
survived = []
for f, a, b in MUTATIONS:
    p = ROOT / f
    src = p.read_text()
    assert a in src, (f, a)
    p.write_text(src.replace(a, b, 1))
    try:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
                           cwd=REPO, capture_output=True, text=True)
    finally:
        p.write_text(src)
    print(("killed  " if r.returncode else "SURVIVED"), f, a.strip()[:70], flush=True)
    if not r.returncode:
        survived.append((f, a))
print(f"{len(MUTATIONS) - len(survived)}/{len(MUTATIONS)} killed")
