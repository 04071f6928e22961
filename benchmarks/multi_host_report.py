"""The report of ``multi_host_launch.py``: the table of medians, where an nbaccel 2-host
launch's time goes (its phases), and issue 15's target lines, from the raw samples."""

from __future__ import annotations

from typing import Any

from bench_util import median, seconds, tail, verdict

TARGET_FIRST_OVER_IMPORT_SSH = 1.2
TARGET_WARM_OVER_ONE_HOST = 3.0

Sample = dict[str, Any]  # {"ready": s, "whole": s, ...} or {"error": text, "whole": s}

# Phases of an nbaccel 2-host launch: (name, mark it starts at, mark it ends at).
PHASES = (
    ("preflight (ssh + probe)", "call", "preflight"),
    ("agents up (ssh + import torch)", "preflight", "agent"),
    ("rendezvous + fork workers", "agent", "started"),
    ("process group init", "started", "entered"),
    ("first all_reduce", "entered", "ready"),
    ("teardown on hosts", "ready", "done"),
    ("channels close, run ends", "done", "whole"),
)


def row(samples: list[Sample]) -> dict[str, Any]:
    kept = [sample for sample in samples if "error" not in sample]
    return {
        "ready": median([s["ready"] for s in kept]),
        "whole": median([s["whole"] for s in kept]),
        "n": len(kept),
        "fail": len(samples) - len(kept),
        "errors": sorted({s["error"] for s in samples if "error" in s}),
    }


def summarize(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Rows of the table: name -> medians, n, failures (or why a way is missing)."""
    probes = data["probes"]

    def probe_row(ready: str | None, whole: str) -> dict[str, Any]:
        found = [p for p in probes if whole in p]
        ready_median = median([p[ready] for p in found]) if ready else None
        whole_median = median([p[whole] for p in found])
        return {"ready": ready_median, "whole": whole_median, "n": len(found), "fail": 0}

    rows = {
        "import torch": probe_row("import_statement", "import_process"),
        "ssh true": probe_row(None, "ssh"),
    }
    if any("ssh_import" in p for p in probes):
        rows["ssh+import torch x2"] = probe_row(None, "ssh_import")
    names = {"hosts": "nbaccel 2 hosts", "one": "nbaccel 1 host"}
    for way, reports in data["reports"].items():
        broken = [r for r in reports if "failed" in r]
        if broken:
            rows[names[way]] = {"note": f"failed: {broken[0]['failed']}"}
            continue
        first = "first" if way == "hosts" else "warm-up"
        rows[f"{names[way]} {first}"] = row([s for r in reports for s in r["first"]])
        rows[f"{names[way]} warm"] = row([s for r in reports for s in r["later"]])
    rows["torchrun 2 hosts"] = row(data["torchrun"])
    return rows


KINDS = ("first", "later")  # a driver's first launch (cold agents), its later ones (warm)


def hosts_samples(data: dict[str, Any], kind: str) -> list[Sample]:
    return [s for r in data["reports"]["hosts"] for s in r.get(kind, []) if "marks" in s]


def breakdown(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Median duration of each phase of the nbaccel 2-host launches, first and warm apart."""
    phases = []
    for name, begin, end in PHASES:
        phase: dict[str, Any] = {"phase": name}
        for kind in KINDS:
            samples = hosts_samples(data, kind)
            spans = [
                s["marks"][end] - s["marks"][begin]
                for s in samples
                if {begin, end} <= set(s["marks"])
            ]
            phase[kind] = median(spans)
        phases.append(phase)
    return phases


def format_table(rows: dict[str, dict[str, Any]]) -> list[str]:
    base = rows.get("torchrun 2 hosts", {}).get("whole")
    lines = [
        f"{'way':<24}{'ready s':>9}{'whole s':>9}{'n':>4}{'fail':>5}  whole / torchrun",
        "-" * 70,
    ]
    for name, values in rows.items():
        if "note" in values:
            lines.append(f"{name:<24}{values['note'].splitlines()[0]}")
            continue
        ratio = "-"
        if base and values["whole"] is not None and "2 hosts" in name:
            ratio = f"{values['whole'] / base:.2f}x"
        lines.append(
            f"{name:<24}{seconds(values['ready']):>9}{seconds(values['whole']):>9}"
            f"{values['n']:>4}{values['fail']:>5}  {ratio}"
        )
    lines.append(
        "(import torch: 'ready' = the statement, 'whole' = python -c wall time; ssh true: one"
        " connection running `true`; ssh+import torch x2: `python -c 'import torch'`"
        " (then os._exit) over ssh"
        " on both hosts at once (until both end), the floor of a cold agent here; nbaccel"
        " 2 hosts 'first' = a fresh driver's first launch (SSH, agents and their import torch),"
        " 'warm' = the same driver's next launches, on the agents kept from the first;"
        " nbaccel 1 host 'warm-up' starts the helper, 'warm' = the launches after it)"
    )
    for name, values in rows.items():
        if "\n" in values.get("note", ""):
            lines.append(f"{name} {values['note']}")
        for error in values.get("errors", []):
            # An agent's failure ends with its traceback's last lines: they tell what broke.
            lines.append(f"{name} error: {tail(error, 12)}")
    return lines


def format_breakdown(data: dict[str, Any], phases: list[dict[str, Any]]) -> list[str]:
    counts = {kind: len(hosts_samples(data, kind)) for kind in KINDS}
    whole = {k: median([s["whole"] for s in hosts_samples(data, k)]) for k in KINDS}
    lines = [
        "Where an nbaccel 2-host launch's time goes (medians of"
        f" {counts['first']} first and {counts['later']} warm launches; share of the whole call):",
        f"{'phase':<34}{'first s':>9}{'share':>7}{'warm s':>9}{'share':>7}",
    ]
    for phase in phases:
        cells = ""
        for kind in KINDS:
            value, total = phase[kind], whole[kind]
            share = "-" if not total or value is None else f"{value / total:.0%}"
            cells += f"{seconds(value):>9}{share:>7}"
        lines.append(f"{phase['phase']:<34}{cells}")
    lines.append(
        f"{'whole call':<34}{seconds(whole['first']):>9}{'':>7}{seconds(whole['later']):>9}"
    )
    marks = [s["marks"] for s in data["torchrun"] if "marks" in s]
    if marks:
        keys = ("started", "imported", "entered", "ready", "whole")
        at = {key: median([m[key] for m in marks]) for key in keys}
        lines.append(
            "torchrun 2 hosts, the later rank, from the call (medians): worker interpreter up"
            f" {seconds(at['started'])} s, its import torch done {seconds(at['imported'])} s,"
            f" process group {seconds(at['entered'])} s, ready {seconds(at['ready'])} s,"
            f" whole {seconds(at['whole'])} s"
        )
    return lines


def format_targets(rows: dict[str, dict[str, Any]]) -> list[str]:
    first, later = rows.get("nbaccel 2 hosts first", {}), rows.get("nbaccel 2 hosts warm", {})
    warm, peer = rows.get("nbaccel 1 host warm", {}), rows.get("torchrun 2 hosts", {})
    torch_row, ssh_row = rows["import torch"], rows["ssh true"]
    lines = []
    if first.get("ready") is not None and torch_row["whole"] and ssh_row["whole"]:
        reference = torch_row["whole"] + ssh_row["whole"]
        ratio = first["ready"] / reference
        lines.append(
            f"target first launch on 2 hosts, ready: median {first['ready']:.3f} s <="
            f" {TARGET_FIRST_OVER_IMPORT_SSH} x (import torch {torch_row['whole']:.3f} s + ssh"
            f" {ssh_row['whole']:.3f} s = {reference:.3f} s) = "
            f"{TARGET_FIRST_OVER_IMPORT_SSH * reference:.3f} s (ratio {ratio:.2f})"
            f"  {verdict(ratio <= TARGET_FIRST_OVER_IMPORT_SSH)}"
        )
        floor = rows.get("ssh+import torch x2", {}).get("whole")
        if floor:
            lines.append(
                f"  (for reference: whole call {first['whole']:.3f} s; ready over ssh+import"
                f" torch on both hosts at once ({floor:.3f} s), this machine's floor for two"
                f" cold agents: {first['ready'] / floor:.2f})"
            )
    if later.get("ready") is not None and warm.get("ready") and warm.get("whole"):
        for key in ("ready", "whole"):
            ratio = later[key] / warm[key]
            lines.append(
                f"target warm relaunch on 2 hosts, {key}: median {later[key]:.3f} s <="
                f" {TARGET_WARM_OVER_ONE_HOST:g} x 1-host warm {warm[key]:.3f} s ="
                f" {TARGET_WARM_OVER_ONE_HOST * warm[key]:.3f} s (ratio {ratio:.1f})"
                f"  {verdict(ratio <= TARGET_WARM_OVER_ONE_HOST)}"
            )
    if first.get("ready") is not None and peer.get("ready"):
        for key in ("ready", "whole"):
            ratio = first[key] / peer[key]
            lines.append(
                f"peer nbaccel 2 hosts / torchrun 2 hosts over ssh, {key}: {first[key]:.3f} s /"
                f" {peer[key]:.3f} s = {ratio:.2f} (<= 1: at least as fast)  {verdict(ratio <= 1)}"
            )
    return lines or ["targets: not checked (missing measurements)"]
