"""bench/core.py stays runnable and measures what it says (a smoke run only;
the figures themselves come from `python bench/core.py`)."""

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from rebuno_proto import canonical_json

BENCH = Path(__file__).resolve().parent.parent / "bench" / "core.py"


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_core", BENCH)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_core", module)
    spec.loader.exec_module(module)
    return module


def test_inputs_are_typical_tool_arguments() -> None:
    bench = load()
    for target in (200, 2_000, 20_000):
        raw = bench.tool_args(target)
        assert target <= len(raw) <= target * 1.5
        text = raw.decode("ascii")  # sent the SDK's way: ensure_ascii
        assert "\\u" in text
        assert "<" in text
        assert "&" in text
        assert "null" in text
        assert "false" in text
        assert "." in text
        assert canonical_json(raw) == canonical_json(canonical_json(raw))
    assert bench.tool_args(2_000) == bench.tool_args(2_000)  # deterministic


def test_json_output(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load()
    assert bench.main(["--json", "--repeat", "1", "--min-time", "0.0005"]) == 0
    report = json.loads(capsys.readouterr().out)
    results = report["results"]
    assert [(r["operation"], r["size"]) for r in results] == [
        (op, size)
        for size in ("0.2 KB", "2 KB", "20 KB")
        for op in ("canonical_json", "args_hash", "step_id")
    ]
    for r in results:
        assert r["ours_ops_per_s"] > 0
        assert r["floor_ops_per_s"] > 0
        assert r["ratio"] == pytest.approx(r["floor_ops_per_s"] / r["ours_ops_per_s"])
    assert report["canonical_target_ratio"] == 3.0


def test_table_output(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load()
    assert bench.main(["--repeat", "1", "--min-time", "0.0005"]) == 0
    out = capsys.readouterr().out
    assert "ours ops/s" in out
    assert "floor ops/s" in out
    assert out.count("canonical_json") >= 3
    assert "target" in out.splitlines()[-1]
