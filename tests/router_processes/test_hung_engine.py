"""A hung VE (the sim's `hang_after` fault: it takes the encode and never answers, while its
/health keeps saying 200) costs each affected request at most its derived deadline, is then
ejected and kept out, and comes back only once a serving probe gets an answer again."""

from __future__ import annotations

import time

import httpx
import openai

from epd_kit.testing.images import image_part, png_data_url, user_message

from .harness import Stack, wait_until

DEADLINE_S = 1.0  # timeouts.encode_base_s, with no per-token part


def test_a_hung_ve_costs_its_deadline_then_stays_out_until_it_serves(ckpt, tmp_path, oracle):
    stack = Stack.start(
        ckpt,
        tmp_path,
        n_ve=2,
        n_pd=1,
        sim_env={"epd-ve-0": {"EPD_SIM_HANG_AFTER": "0"}},
        timeouts={"encode_base_s": DEADLINE_S, "encode_per_1k_tokens_s": 0},
    )
    try:
        router, hung = stack.router, stack.ves[0]
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=30)

        def ask(seed: int) -> float:
            messages = [user_message("What is it?", image_part(png_data_url(64, 48, seed=seed)))]
            t0 = time.monotonic()
            resp = client.chat.completions.create(model="m", messages=messages, max_tokens=4)
            assert resp.choices[0].token_ids == oracle.expect(messages, 4)[1]
            return time.monotonic() - t0

        slowest = 0.0
        for seed in range(600, 640):  # images whose first HRW choice is the hung VE wait, then move
            slowest = max(slowest, ask(seed))
            if not router.pools()["epd-ve-0"]["healthy"]:
                break
        pools = router.pools()
        assert pools["epd-ve-0"]["healthy"] is False and pools["epd-ve-0"]["needs_serving_probe"] is True
        assert DEADLINE_S <= slowest < DEADLINE_S + 2.0  # waited for its deadline, not for 600 s
        assert "no answer within 1.0s" in pools["epd-ve-0"]["last_error"]

        time.sleep(1.5)  # several probe rounds: /health says 200, the serving probe hangs
        assert httpx.get(hung.url + "/health").status_code == 200
        assert router.pools()["epd-ve-0"]["healthy"] is False
        assert max(ask(seed) for seed in range(700, 704)) < DEADLINE_S  # the other VE, at once

        httpx.put(hung.url + "/sim/faults", json={}).raise_for_status()  # it serves again
        wait_until(lambda: router.pools()["epd-ve-0"]["healthy"], 10, "readmitted by a serving probe")
        served = router.pools()["epd-ve-0"]["served"]
        for seed in range(800, 820):
            ask(seed)
            if router.pools()["epd-ve-0"]["served"] > served:
                break
        assert router.pools()["epd-ve-0"]["served"] > served
    finally:
        stack.stop()
