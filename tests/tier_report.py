"""The closing table of tests/run.sh: ``python tests/tier_report.py RESULTS_DIR``.

RESULTS_DIR holds ``tiers`` (one ``name exit-code seconds`` line per tier; ``skipped`` for the
exit code of a tier this machine cannot run) and, per tier, the
JUnit XML of each rank (``<tier>/rank<R>.xml``) and the output of ranks other than 0
(``<tier>/rank<R>.log``). Counts come from rank 0's XML (every rank runs the same tests). For a
failed tier, the output of every other rank that failed or wrote no XML (it was aborted) is
printed, so a failure on rank 3 is visible without flooding passing runs with copies.
"""
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def counts(xml: Path) -> dict | None:
    """passed/failed/skipped of one JUnit XML file (failures and errors count as failed)."""
    try:
        suite = ET.parse(xml).getroot()
    except (OSError, ET.ParseError):
        return None
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    failed = n["failures"] + n["errors"]
    return {"passed": n["tests"] - failed - n["skipped"], "failed": failed, "skipped": n["skipped"]}


def other_ranks_output(tier_dir: Path) -> str:
    """The logs of the ranks other than 0 that failed, or were ended before writing their XML."""
    parts = []
    for log in sorted(tier_dir.glob("rank*.log"), key=lambda p: int(p.stem[4:])):
        c = counts(log.with_suffix(".xml"))
        if c is None or c["failed"]:
            parts.append(f"--- {tier_dir.name} {log.stem} ---\n{log.read_text(errors='replace')[-20000:]}")
    return "\n".join(parts)


def main(results: Path) -> None:
    rows = []
    for line in (results / "tiers").read_text().splitlines():
        name, rc, seconds = line.split()
        c = counts(results / name / "rank0.xml") or {}
        result = {"0": "ok", "skipped": "SKIPPED (see its line above)"}.get(rc, f"FAILED (exit {rc})")
        rows.append((name, result, *(str(c.get(k, "-")) for k in
                     ("passed", "failed", "skipped")), seconds))
        if rc not in ("0", "skipped") and (results / name).is_dir():
            shown = other_ranks_output(results / name)
            if shown:
                print(f"\n=== tier {name} failed: output of the other ranks ===\n{shown}")
    head = ("tier", "result", "passed", "failed", "skipped", "seconds")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    print()
    for r in [head, *rows]:
        print("  ".join(v.ljust(w) if i < 2 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths))))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
