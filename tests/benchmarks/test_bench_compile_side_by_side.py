"""`benchmarks/bench_compile_side_by_side.py` on the CPU: each case in a fresh process, two copies of the decode
program of other widths side by side, in threads and sent to two compile worker processes, a row per case with
each program's seconds."""

import re

import bench_compile_side_by_side
import pytest


def test_cases_compile_and_make_a_row_each(capsys):
    # Two copies, without and with workers: each case is a fresh process (and two more with workers), about 14 s
    # on a 2-core CPU, so the one-copy cases, the same code with a count of 1, are left to the device's runs.
    assert bench_compile_side_by_side.main(["--vae", "tiny", "--height", "8", "--width", "12", "--copies", "2",
                                            "--workers", "0,2"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^\| (\d) \| (\d) \| ([\d.]+) \| ([\d. /]+) \| ([^|]+) \| ([^|]+) \|$", out, re.M)
    assert [r[:2] for r in rows] == [("2", "0"), ("2", "2")], out
    for n, workers, wall, each, busy, pool in rows:
        seconds = [float(s) for s in each.split(" / ")]
        assert len(seconds) == int(n) and all(0 < s <= float(wall) + 0.01 for s in seconds)
        assert re.fullmatch(r"\d+% of \d+|—", busy.strip()), busy
        if workers == "0":
            assert pool.strip() == "—"
        else:  # every copy compiled in a worker once both were ready
            assert re.fullmatch(rf"2 ready at [\d.]+ s, {n} compiled there", pool.strip()), pool
    with pytest.raises(SystemExit, match="--copies must be"):
        bench_compile_side_by_side.main(["--width", "8", "--copies", "3"])
    with pytest.raises(SystemExit, match="--workers must be"):
        bench_compile_side_by_side.main(["--workers", "-1"])
