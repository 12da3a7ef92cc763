"""bench.image_path runs end to end at a tiny size (sims, this checkout's router and the
baseline's, 127.0.0.1 only), so the section's harness cannot rot."""

from __future__ import annotations

import json

from bench import image_path


def test_image_path_tiny(tmp_path):
    rec = image_path.main(
        ["--rounds", "1", "--text-requests", "3", "--image-requests", "2", "--warmup", "1", "--out-dir", str(tmp_path)]
    )
    res = rec.results
    for router in ("current", "baseline"):
        for kind in image_path.KINDS:
            cell = res[router][kind]
            assert cell["errors"] == 0 and cell["requests"] >= 1 and cell["cpu_ms_per_request"] >= 0
    assert res["sim_decode"]["pybase64_b64decode_validate_ms"] < res["sim_decode"]["stdlib_b64decode_validate_ms"]
    assert json.loads((tmp_path / "image_path.json").read_text())["section"] == "image_path"
