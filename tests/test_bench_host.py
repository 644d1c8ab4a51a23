"""``kvpage bench host``: the full engine over an instant token source."""

from __future__ import annotations

import pytest
from kvpage.bench import host
from kvpage.cli import main


@pytest.mark.parametrize("mode", host.MODES)
def test_host_bench_runs_the_engine_and_reports_sane_numbers(mode: str) -> None:
    result = host.measure(8, mode, steps=6)
    assert result.running == 8 and result.steps == 6
    assert result.us_per_step > 0
    assert result.us_per_seq == pytest.approx(result.us_per_step / 8)
    parts = (result.schedule_us, result.update_us, result.inputs_us)
    assert all(p > 0 for p in parts) and sum(parts) < result.us_per_step
    if mode == "streaming":  # every running sequence gets a delta each step, with text
        assert result.outputs_per_step == 8
        assert result.chars_per_step > 8
    else:  # nothing finishes in the timed window
        assert result.outputs_per_step == 0 and result.chars_per_step == 0


def test_instant_runner_streams_the_text_it_was_given() -> None:
    """The token source is the tokenized TEXT, so the engine's text is TEXT's."""
    from kvpage.sampling_params import SamplingParams

    engine = host.build_host_engine(2)
    params = SamplingParams(max_tokens=60, ignore_eos=True, temperature=0)
    engine.add_request("a", [20, 21, 22], params)
    texts = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                texts[out.request_id] = out.outputs[0].text
    assert len(texts["a"]) > 60 and texts["a"] in host.TEXT * 5


def test_bench_host_cli_prints_a_table(capsys: pytest.CaptureFixture) -> None:
    main(["bench", "host", "--running", "4", "--mode", "streaming", "--steps", "3"])
    out = capsys.readouterr().out
    assert "us/seq/step" in out and "streaming" in out
