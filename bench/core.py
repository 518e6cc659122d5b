"""Throughput of the identity core: canonical JSON, args hash and step id.

Each operation runs on typical tool arguments of about 0.2, 2 and 20 KB
(strings with some non-ASCII and `<>&`, integers, floats, booleans, nulls,
nested lists and objects), encoded the way the published SDK sends them
(`json.dumps` defaults). Each figure is reported next to a floor measured in
the same run on the same bytes:

* `canonical_json`: `json.loads` + `json.dumps(sort_keys=True, separators=(",", ":"))`,
  the standard library doing the least a canonicaliser must do;
* `args_hash`: `hashlib.sha256(raw).hexdigest()`;
* `step_id`: `hashlib.sha256(preimage).hexdigest()` over its own preimage.

Times are the best of several repeats (`timeit`). Run `python bench/core.py`
for a table, `--json` for machine-readable results.

Usage:
    python bench/core.py [--json] [--repeat N] [--min-time SECONDS]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import random
import sys
import timeit
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rebuno_proto import args_hash, canonical_json, step_id

EXECUTION_ID = "0192f1a0-0000-7000-8000-000000000000"
TARGET_SIZES = {"0.2 KB": 200, "2 KB": 2_000, "20 KB": 20_000}
CANONICAL_TARGET_RATIO = 3.0

_WORDS = (
    "search",
    "result",
    "summary",
    "invoice",
    "customer",
    "order",
    "shipping",
    "status",
    "pending",
    "approved",
    "report",
    "quarterly",
    "revenue",
    "growth",
    "market",
    "analysis",
    "draft",
    "final",
    "café",
    "naïve",
    "résumé",
    "Zürich",
    "São",
    "Paulo",
    "東京",
    "日本語",
    "Ωmega",
    "→",
    "✓",
    "🙂",
    "<b>bold</b>",
    "AT&T",
    "R&D",
    "a<b",
    "c>d",
)


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def _document(rng: random.Random, i: int) -> dict[str, Any]:
    return {
        "id": 100_000 + i,
        "title": _text(rng, rng.randint(2, 6)),
        "score": round(rng.random(), 4),
        "price": {
            "amount": round(rng.uniform(1, 500), 2),
            "currency": rng.choice(["EUR", "USD", "JPY"]),
        },
        "in_stock": rng.random() < 0.7,
        "discontinued_at": None,
        "tags": [rng.choice(_WORDS) for _ in range(rng.randint(0, 4))],
        "body": _text(rng, rng.randint(8, 30)),
        "dims": [rng.randint(1, 300), rng.randint(1, 300), rng.random() * 10],
    }


def tool_args(size: int, seed: int = 7) -> bytes:
    """Typical tool arguments of about `size` bytes, as the SDK sends them."""
    rng = random.Random(seed)
    args: dict[str, Any] = {
        "query": _text(rng, 4),
        "limit": 25,
        "threshold": 0.75,
        "include_archived": False,
        "cursor": None,
        "filters": {"lang": "en", "since": "2026-01-01T00:00:00Z", "owner": "R&D <team>"},
        "documents": [],
    }
    raw = json.dumps(args).encode()
    i = 0
    while len(raw) < size:
        args["documents"].append(_document(rng, i))
        i += 1
        raw = json.dumps(args).encode()
    if len(raw) > size * 1.5 and args["documents"]:
        args["documents"].pop()
        args["documents"].append({"id": i, "note": _text(rng, 3)})
        raw = json.dumps(args).encode()
    return raw


def _sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _floor_canonical(raw: bytes) -> bytes:
    return json.dumps(json.loads(raw), sort_keys=True, separators=(",", ":")).encode()


def best_time(fn: Callable[[], object], *, repeat: int, min_time: float) -> float:
    """Seconds per call: best of `repeat` runs of an auto-ranged loop."""
    timer = timeit.Timer(fn)
    number = 1
    while True:
        elapsed = timer.timeit(number)
        if elapsed >= min_time:
            break
        number *= 2 if elapsed == 0 else max(2, min(10, int(min_time / elapsed) + 1))
    return min(timer.repeat(repeat=repeat, number=number)) / number


def measure(*, repeat: int, min_time: float) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    for label, size in TARGET_SIZES.items():
        raw = tool_args(size)
        digest = args_hash(raw)
        preimage = b"".join(
            b"%d:%s" % (len(f.encode()), f.encode())
            for f in (EXECUTION_ID, "tool_call", "search", digest, "0")
        )
        assert hashlib.sha256(preimage).hexdigest() == step_id(
            EXECUTION_ID, "tool_call", "search", digest, 0
        )
        cases: list[tuple[str, Callable[[], object], Callable[[], object]]] = [
            ("canonical_json", partial(canonical_json, raw), partial(_floor_canonical, raw)),
            ("args_hash", partial(args_hash, raw), partial(_sha256_hex, raw)),
            (
                "step_id",
                partial(step_id, EXECUTION_ID, "tool_call", "search", digest, 0),
                partial(_sha256_hex, preimage),
            ),
        ]
        for name, ours, floor in cases:
            t_ours = best_time(ours, repeat=repeat, min_time=min_time)
            t_floor = best_time(floor, repeat=repeat, min_time=min_time)
            results.append(
                {
                    "operation": name,
                    "size": label,
                    "bytes": len(raw) if name != "step_id" else len(preimage),
                    "ours_ops_per_s": 1.0 / t_ours,
                    "floor_ops_per_s": 1.0 / t_floor,
                    "ratio": t_ours / t_floor,
                }
            )
    return results


def table(results: list[dict[str, Any]]) -> str:
    head = (
        f"{'operation':<16}{'args':>8}{'bytes':>8}{'ours ops/s':>14}{'floor ops/s':>14}{'ratio':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(
            f"{r['operation']:<16}{r['size']:>8}{r['bytes']:>8}{r['ours_ops_per_s']:>14,.0f}"
            f"{r['floor_ops_per_s']:>14,.0f}{r['ratio']:>7.2f}x"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print results as JSON")
    parser.add_argument("--repeat", type=int, default=7, help="repeats per figure (best is kept)")
    parser.add_argument("--min-time", type=float, default=0.05, help="seconds per timed loop")
    args = parser.parse_args(argv)
    results = measure(repeat=args.repeat, min_time=args.min_time)
    worst = max(r["ratio"] for r in results if r["operation"] == "canonical_json")
    if args.json:
        print(
            json.dumps(
                {
                    "python": platform.python_version(),
                    "implementation": platform.python_implementation(),
                    "canonical_target_ratio": CANONICAL_TARGET_RATIO,
                    "canonical_worst_ratio": worst,
                    "results": results,
                },
                indent=2,
            )
        )
    else:
        version = platform.python_version()
        print(f"rebuno_proto identity core, Python {version}; ratio = our time / floor time")
        print(table(results))
        verdict = "within" if worst <= CANONICAL_TARGET_RATIO else "OUTSIDE"
        target = f"{CANONICAL_TARGET_RATIO:.0f}x"
        print(f"canonical_json worst ratio {worst:.2f}x: {verdict} the {target} target")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
