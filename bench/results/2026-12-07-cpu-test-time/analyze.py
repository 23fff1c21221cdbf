"""Sum the launches of ``launch_audit.py``'s log that repeat an earlier one (same digest): per module, within one
test, across tests. ``python analyze.py launches.tsv``"""

import collections
import sys

rows = [line.rstrip("\n").split("\t") for line in open(sys.argv[1])]
tot = sum(float(r[3]) for r in rows)
first: dict[str, str] = {}
same_test: collections.Counter = collections.Counter()
cross: collections.Counter = collections.Counter()
cross_n: collections.Counter = collections.Counter()
per_mod: collections.Counter = collections.Counter()
rep_mod: collections.Counter = collections.Counter()
for node, _kernel, d, t_s in rows:
    t = float(t_s)
    mod = node.split("::")[0]
    per_mod[mod] += t
    if d.startswith("undigestible"):
        continue
    if d not in first:
        first[d] = node
        continue
    f = first[d]
    rep_mod[mod] += t
    if f == node:
        same_test[node] += t
    else:
        key = (f.split("[")[0], node.split("[")[0])
        cross[key] += t
        cross_n[key] += 1
print(f"launches {len(rows)}, launch time {tot:.1f} s; repeated launches {sum(rep_mod.values()):.1f} s "
      f"(same test {sum(same_test.values()):.1f} s, across tests {sum(cross.values()):.1f} s)")
print("\nlaunch time per module / of it repeats:")
for m, t in per_mod.most_common(25):
    print(f"  {t:7.1f} {rep_mod[m]:6.1f}  {m}")
print("\nrepeats within one test:")
for n, t in same_test.most_common(25):
    print(f"  {t:6.2f}  {n}")
print("\nrepeats across tests (first test -> repeating test):")
for (a, b), t in cross.most_common(40):
    print(f"  {t:6.2f} {cross_n[(a, b)]:4d}  {a}  ->  {b}")
