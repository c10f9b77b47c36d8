"""Run diffusers' own transformer model tests on stock and on boosted models and compare the outcomes per test.

diffusers' tests ship in its repository, not in the wheel: extract them first, e.g.

    git -C <diffusers checkout> archive <rev> tests | tar x -C /tmp/difftests
    python scripts/run_diffusers_model_tests.py --tests-dir /tmp/difftests --out /tmp/difftests-out \\
        --rev "<rev> (<describe>)" --table docs/models/diffusers-model-tests.table.md

Each test file runs twice in its own pytest process (one after the other, never in parallel): stock, then with
LITE_BOOST_DIFFTESTS=1 (scripts/diffusers_model_tests_conftest.py, copied next to ``tests/``, makes each tester's
``model_class`` boost its instances). CPU only (CUDA_VISIBLE_DEVICES=""), HF_HUB_OFFLINE=1: hub tests skip or fail
the same way in both runs. Outcomes come from pytest's junit XML; the conftest says which model class each test
exercises and which lite_boost path (family, generic, refused) the class takes. A regression is a test that passes
stock and does not pass boosted. ``--reuse`` keeps the results of files already run (their XML exists).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CONFTEST = os.path.join(HERE, "diffusers_model_tests_conftest.py")
PATTERN = "tests/models/transformers/test_models_transformer_*.py"
MODES = ("stock", "boosted")


def run_file(path: str, mode: str, args) -> dict:
    """Run one test file in one mode; returns {"rc", "seconds"} and leaves <out>/<mode>/<name>.xml / .json / .log."""
    name = os.path.splitext(os.path.basename(path))[0]
    out = os.path.join(args.out, mode)
    os.makedirs(out, exist_ok=True)
    xml, rep, log = (os.path.join(out, name + ext) for ext in (".xml", ".json", ".log"))
    if args.reuse and os.path.exists(xml) and os.path.exists(rep):
        return {"rc": None, "seconds": None, "reused": True}
    env = dict(os.environ, HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="", LITE_BOOST_DIFFTESTS_REPORT=rep,
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    env.pop("LITE_BOOST_DIFFTESTS", None)
    if mode == "boosted":
        env["LITE_BOOST_DIFFTESTS"] = "1"
    cmd = ["timeout", str(args.timeout), sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA",
           f"--junitxml={xml}", os.path.relpath(path, args.tests_dir)]
    if args.lock:
        cmd = ["flock", args.lock] + cmd
    if args.nice:
        cmd = ["nice", "-n", str(args.nice)] + cmd
    t0 = time.monotonic()
    with open(log, "w") as f:
        rc = subprocess.call(cmd, cwd=args.tests_dir, env=env, stdout=f, stderr=subprocess.STDOUT)
    return {"rc": rc, "seconds": round(time.monotonic() - t0, 1)}


def all_refused(path: str, args) -> bool:
    """True when the stock run's report names the file's model classes and lite_boost refuses every one (the
    boosted run would run the same stock models again)."""
    name = os.path.splitext(os.path.basename(path))[0]
    try:
        with open(os.path.join(args.out, "stock", name + ".json")) as f:
            paths = json.load(f)["paths"]
    except (OSError, ValueError, KeyError):
        return False
    return bool(paths) and all(p.startswith("refused") for p in paths.values())


def outcomes(xml: str) -> dict[str, tuple[str, str]]:
    """{test node id: (passed | failed | error | skipped, first line of the message)} from a junit XML file."""
    if not os.path.exists(xml):
        return {}
    res = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        parts = classname.split(".")
        # classname "tests.models.transformers.test_x.TestY" -> "tests/models/transformers/test_x.py::TestY"
        for i in range(len(parts), 0, -1):
            if parts[i - 1].startswith("test_"):
                nodeid = "/".join(parts[:i]) + ".py" + "".join("::" + p for p in parts[i:]) + "::" + name
                break
        else:
            nodeid = classname + "::" + name
        state, msg = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                state = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                msg = (child.get("message") or child.text or "").strip().splitlines()
                msg = msg[0][:300] if msg else ""
                if state == "failed" or state == "error":
                    break
        res[nodeid] = (state, msg)
    return res


def collect(args, files) -> dict:
    """Per model class: path, tests, passed stock / boosted, regressions; plus per-file timings and exit codes."""
    classes: dict[str, dict] = defaultdict(lambda: {"path": None, "files": set(), "tests": 0, "stock": 0,
                                                     "boosted": 0, "regressions": [], "fixed": 0})
    for path in files:
        name = os.path.splitext(os.path.basename(path))[0]
        res, rep = {}, {}
        for mode in MODES:
            res[mode] = outcomes(os.path.join(args.out, mode, name + ".xml"))
            try:
                with open(os.path.join(args.out, mode, name + ".json")) as f:
                    rep[mode] = json.load(f)
            except (OSError, ValueError):
                rep[mode] = {"paths": {}, "items": {}}
        items = {**rep["stock"]["items"], **rep["boosted"]["items"]}
        # tests outside a tester class (module-level functions) belong to the file's one model class, if it has one
        only = set(items.values())
        default = only.pop() if len(only) == 1 else f"({name})"
        for nodeid in sorted(set(res["stock"]) | set(res["boosted"])):
            cls = items.get(nodeid, default)
            row = classes[cls]
            row["files"].add(os.path.basename(path))
            path_taken = rep["boosted"]["paths"].get(cls) or rep["stock"]["paths"].get(cls)
            if path_taken:
                row["path"] = path_taken
            if (row["path"] or "").startswith("refused"):
                row["tests"] += 1
                row["stock"] += res["stock"].get(nodeid, ("missing",))[0] == "passed"
                continue
            row["tests"] += 1
            s = res["stock"].get(nodeid, ("missing", ""))
            b = res["boosted"].get(nodeid, ("missing", "did not run (file timed out or crashed)"))
            row["stock"] += s[0] == "passed"
            row["boosted"] += b[0] == "passed"
            if s[0] == "passed" and b[0] != "passed":
                row["regressions"].append((nodeid, b[0], b[1]))
            if s[0] != "passed" and b[0] == "passed":
                row["fixed"] += 1
    return classes


def refusal(message: str) -> bool:
    """Whether a boosted failure is lite_boost refusing the call (a LoaderError raised before anything changed)."""
    return message.startswith(("lite_boost.errors.LoaderError", "LoaderError"))


def table(classes: dict, header: str = "") -> str:
    lines = [header, "",
             "| class | path | tests | passed stock | passed boosted | regressions |",
             "|---|---|---:|---:|---:|---|"] if header else [
             "| class | path | tests | passed stock | passed boosted | regressions |", "|---|---|---:|---:|---:|---|"]
    totals = [0, 0, 0, 0]
    for cls in sorted(classes):
        row = classes[cls]
        path = row["path"] or "?"
        if path.startswith("refused"):
            path = "refused"
        regs = "; ".join(f"`{'::'.join(n.split('::')[1:])}` ({'refusal' if refusal(msg) else st}: "
                         f"{msg.replace('|', '/')[:120]})" for n, st, msg in row["regressions"]) or "none"
        if path == "refused":
            lines.append(f"| {cls} | refused | {row['tests']} | {row['stock']} | - | not run boosted |")
            continue
        lines.append(f"| {cls} | {path} | {row['tests']} | {row['stock']} | {row['boosted']} | {regs} |")
        totals = [a + b for a, b in zip(totals, (row["tests"], row["stock"], row["boosted"], len(row["regressions"])))]
    claimed = sum(1 for r in classes.values() if not (r["path"] or "").startswith("refused"))
    refusals = sum(refusal(m) for r in classes.values() if not (r["path"] or "").startswith("refused")
                   for _, _, m in r["regressions"])
    lines.append(f"| **{claimed} classes boosted** | | {totals[0]} | {totals[1]} | {totals[2]} | "
                 f"{totals[3]} ({refusals} refusals, {totals[3] - refusals} other) |")
    refused = {c: r["path"] for c, r in classes.items() if (r["path"] or "").startswith("refused")}
    if refused:
        lines += ["", "Refused classes (lite_boost does not claim them; their tests ran stock only):", ""]
        lines += [f"- {c}: {why[len('refused: '):]}" for c, why in sorted(refused.items())]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tests-dir", required=True, help="folder holding diffusers' extracted tests/ folder")
    p.add_argument("--out", required=True, help="folder for the junit XML, reports and logs")
    p.add_argument("--files", nargs="*", help=f"test files relative to --tests-dir (default: {PATTERN})")
    p.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES)
    p.add_argument("--timeout", type=int, default=1800, help="seconds per file and mode (default 1800)")
    p.add_argument("--lock", help="run each pytest under `flock LOCK` (a machine shared with other heavy jobs)")
    p.add_argument("--nice", type=int, default=0, help="run pytest under `nice -n NICE` (a shared machine)")
    p.add_argument("--reuse", action="store_true", help="keep the results of files already run")
    p.add_argument("--report-only", action="store_true", help="run nothing; build the table from --out")
    p.add_argument("--rev", default="", help="diffusers revision the tests come from (goes into the table header)")
    p.add_argument("--table", help="write the markdown table here (default: print it)")
    p.add_argument("--json", help="write the per-class results as JSON here")
    args = p.parse_args(argv)
    args.tests_dir = os.path.abspath(args.tests_dir)
    if not os.path.isdir(os.path.join(args.tests_dir, "tests")):
        p.error(f"--tests-dir {args.tests_dir!r} has no tests/ folder (extract diffusers' tests there first)")
    os.makedirs(args.out, exist_ok=True)
    shutil.copyfile(CONFTEST, os.path.join(args.tests_dir, "conftest.py"))
    files = [os.path.join(args.tests_dir, f) for f in args.files] if args.files else \
        sorted(glob.glob(os.path.join(args.tests_dir, PATTERN)))
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        p.error(f"--files: no such test file(s) {missing}")
    if not args.report_only:
        timings_path = os.path.join(args.out, "timings.json")
        timings = json.load(open(timings_path)) if os.path.exists(timings_path) else {}
        for path in files:
            for mode in args.modes:
                if mode == "boosted" and all_refused(path, args):
                    print(f"{mode:8s} {os.path.basename(path)}: not run, lite_boost refuses its classes", flush=True)
                    continue
                r = run_file(path, mode, args)
                if not r.get("reused"):
                    timings[f"{mode}/{os.path.basename(path)}"] = r
                    print(f"{mode:8s} {os.path.basename(path)}: rc={r['rc']} {r['seconds']}s", flush=True)
                    with open(timings_path, "w") as f:
                        json.dump(timings, f, indent=1, sort_keys=True)
    classes = collect(args, files)
    header = f"diffusers tests from {args.rev}" if args.rev else ""
    text = table(classes, header)
    if args.table:
        with open(args.table, "w") as f:
            f.write(text)
    else:
        print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({c: {**r, "files": sorted(r["files"])} for c, r in classes.items()}, f, indent=1, sort_keys=True)
    return 1 if any(r["regressions"] for r in classes.values() if not (r["path"] or "").startswith("refused")) else 0


if __name__ == "__main__":
    sys.exit(main())
