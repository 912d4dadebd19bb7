"""Step 4: pair verses, drop chapters whose last non-empty verse differs (+ next chapter), split."""
import sys
from collections import defaultdict
import extract

TEST = {"Acts", "Nehemiah"}
DEV = {"Ruth", "Esther", "Jonah", "Philippians"}


def last_nonempty(vs):
    last = defaultdict(int)
    for (b, c, v), t in vs.items():
        if t:
            last[(b, c)] = max(last[(b, c)], v)
    return last


def split(R, W, verbose=False):
    lr, lw = last_nonempty(R), last_nonempty(W)
    books = {b for b, _ in lr} & {b for b, _ in lw}
    bad = {bc for bc in set(lr) | set(lw)
           if bc[0] in books and lr.get(bc, 0) != lw.get(bc, 0)}
    excluded = set()
    for b, c in bad:
        excluded |= {(b, c), (b, c + 1)}
    pairs = [(k, R[k], W[k]) for k in R if R[k] and W.get(k)]
    out = {"train": [], "dev": [], "test": []}
    dropped = 0
    for k, r, w in pairs:
        if (k[0], k[1]) in excluded:
            dropped += 1
            continue
        s = "test" if k[0] in TEST else "dev" if k[0] in DEV else "train"
        out[s].append((k, r, w))
    if verbose:
        print("paired non-empty:", len(pairs), "dropped by chapter rule:", dropped)
        print("chapters with differing last verse:", len(bad))
        for b, c in sorted(bad, key=lambda x: (extract_order[x[0]], x[1])):
            print(f"   {b} {c}: RV last={lr.get((b,c))} WEB last={lw.get((b,c))}")
    return out


if __name__ == "__main__":
    R = extract.load("spaRV1909eb")
    W = extract.load("engWEB2015eb")
    extract_order = {b: i for i, b in enumerate(extract.book_order(R))}
    out = split(R, W, verbose=True)
    for s in ("train", "dev", "test"):
        print(s, len(out[s]))
