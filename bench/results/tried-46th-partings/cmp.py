import json, sys, math, collections
base = json.load(open(sys.argv[1])); new = json.load(open(sys.argv[2]))
by = collections.defaultdict(list); worse = collections.Counter(); below_paper = 0
for k, b in base.items():
    n = new[k]; prof, model, req, seed = k.split("|")
    r = b["bottleneck"] / n["bottleneck"]  # speedup of new over base
    by[(prof, model, req)].append(math.log(r)); by[("all", "", req)].append(math.log(r))
    if r < 1 - 1e-9: worse[req] += 1
    if n["bottleneck"] > n["paper"] * (1 + 1e-9): below_paper += 1
for key in sorted(by):
    v = by[key]; print(key, f"{(math.exp(sum(v)/len(v))-1)*100:+.3f}%", f"worse {sum(1 for x in v if x < -1e-9)}/{len(v)}")
print("below paper:", below_paper)
