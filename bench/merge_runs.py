"""Merge `sarathi bench` result files (their "runs", sorted by QPS) into one, e.g. the QPS points of
one server taken in several holds:  python -m bench.merge_runs OUT.json A.json B.json ..."""
import json
import sys


def merge(parts: list[str]) -> dict:
    ds = [json.load(open(p)) for p in parts]
    return {"command": [c for d in ds for c in (d["command"] if isinstance(d["command"], list) else [d["command"]])],
            "machine": [x for d in ds for x in (d["machine"] if isinstance(d["machine"], list) else [d["machine"]])],
            "target": ds[0].get("target"), "workload": ds[0].get("workload"), "tbt_slo_s": ds[0].get("tbt_slo_s"),
            "server_per_point": [x for d in ds for x in d.get("server_per_point", [])],
            "merged_from": parts,
            "runs": sorted([r for d in ds for r in d["runs"]], key=lambda r: r["qps"])}


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        sys.exit("usage: python -m bench.merge_runs OUT.json A.json [B.json ...]")
    out, parts = argv[0], argv[1:]
    m = merge(parts)
    json.dump(m, open(out, "w"), indent=1)
    print(out, [r["qps"] for r in m["runs"]])


if __name__ == "__main__":
    main(sys.argv[1:])
