"""``epikv profile list|use|reset``: which band profile each model uses, and changing that on purpose.

Parses arguments and prints; :mod:`epikv.profiles` owns the lookup order, the weak-signal rule and
the user folder. ``use`` is the only command that makes a calibrated profile active.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from pathlib import Path
from typing import Any

from epikv.profiles import (
    REFERENCE,
    ProfileSource,
    install_profile,
    known_models,
    profile_sources,
    reset_profile,
    user_profile_dir,
    weak_signal_warnings,
)

# Why the first source in lookup order is the one in use, by its kind.
_WHY = {
    "user": "a user profile comes before the shipped and the paper's ones",
    "shipped": "no user profile, so the profile shipped with epikv",
    "paper": "no user or shipped profile, so the paper's bands",
}


def add_profile_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="list band profiles; choose the one a model uses")
    actions = p.add_subparsers(dest="profile_action", required=True, title="actions", metavar="ACTION")
    show = actions.add_parser("list", help="every model's profiles, the one in use and why")
    show.add_argument("model", nargs="?", default=None, help="only this model identity")
    show.add_argument("--json", action="store_true")
    show.set_defaults(func=cmd_list)
    use = actions.add_parser("use", help="make a calibrated profile the one its model uses")
    use.add_argument("path", type=Path, help="the profile JSON, e.g. RUN/<model>.json")
    use.add_argument(
        "--force", action="store_true", help="install it even though its calibration says the signal is weak"
    )
    use.set_defaults(func=cmd_use)
    reset = actions.add_parser("reset", help="remove a model's user profile (back to the shipped one)")
    reset.add_argument("model", help="the model identity, as `epikv profile list` shows it")
    reset.set_defaults(func=cmd_reset)


def _row(source: ProfileSource, active: bool) -> dict[str, Any]:
    profile, details = source.profile, source.profile.details
    return {
        "kind": source.kind,
        "origin": source.origin,
        "active": active,
        "num_layers": profile.num_layers,
        "band_a": profile.band_a,
        "band_b": profile.band_b,
        "dataset": details.get("dataset"),
        "n_problems": details.get("n_problems"),
        "date": details.get("date"),
        "weak_signal": weak_signal_warnings(profile),
        "forced": bool(details.get("installed", {}).get("forced", False)),
    }


def listing(model: str | None = None) -> list[dict[str, Any]]:
    """One entry per model: its profiles in lookup order, the active one first, and why it is active."""
    models = [model] if model is not None else known_models()
    out = []
    for name in models:
        sources = profile_sources(name)
        why = _WHY[sources[0].kind] if sources else "no profile: Llama-8B's bands scaled by depth"
        rows = [_row(source, index == 0) for index, source in enumerate(sources)]
        out.append({"model": name, "why": why, "profiles": rows})
    return out


def _describe(row: dict[str, Any]) -> str:
    text = f"A={row['band_a']} B={row['band_b']} of {row['num_layers']} layers  {row['origin']}"
    if row["dataset"]:
        text += f"  (calibrated on {row['dataset']}, {row['n_problems']} problems, {row['date']})"
    if row["weak_signal"]:
        forced = ", installed with --force" if row["forced"] else ""
        text += f"  WEAK SIGNAL: {row['weak_signal'][0]}{forced}"
    return text


def cmd_list(args: argparse.Namespace) -> int:
    entries = listing(args.model)
    if args.json:
        print(json.dumps(entries, indent=2))
        return 0
    for entry in entries:
        print(entry["model"])
        for row in entry["profiles"]:
            print(f"  {'*' if row['active'] else ' '} {_describe(row)}")
        print(f"    in use: {entry['why']}")
    n, a, b = REFERENCE
    print(f"other models: Llama-8B's bands {a}/{b} of {n} scaled by depth, with a warning (calibrate them)")
    print(f"user profiles: {user_profile_dir()}")
    return 0


def cmd_use(args: argparse.Namespace) -> int:
    path, profile = install_profile(args.path, force=args.force)
    weak = weak_signal_warnings(profile)
    if weak:
        print(
            f"epikv profile: WARNING: installed {args.path} although its calibration says the signal is "
            f"weak ({'; '.join(weak)}); every run on {profile.model} now uses A={profile.band_a} "
            f"B={profile.band_b}. Undo with `epikv profile reset {profile.model}`",
            file=sys.stderr,
        )
    print(
        f"epikv profile: {profile.model} now uses A={profile.band_a} B={profile.band_b} from {path} "
        f"(undo: `epikv profile reset {profile.model}`)"
    )
    return 0


def cmd_reset(args: argparse.Namespace) -> int:
    removed = reset_profile(args.model)
    if removed is not None:
        print(f"epikv profile: removed {removed}; {args.model} uses {_fallback(args.model)}")
        return 0
    user_models = [e["model"] for e in listing() if any(r["kind"] == "user" for r in e["profiles"])]
    close = difflib.get_close_matches(args.model, user_models, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    print(f"epikv profile: {args.model} has no user profile, nothing to reset{hint}")
    return 0


def _fallback(model: str) -> str:
    sources = profile_sources(model)
    return sources[0].origin if sources else "Llama-8B's bands scaled by depth (no profile)"
