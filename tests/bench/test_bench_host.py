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
    from kvpage.sampling.params import SamplingParams

    engine = host.build_host_engine(2)
    params = SamplingParams(max_tokens=60, ignore_eos=True, temperature=0)
    engine.add_request("a", [20, 21, 22], params)
    texts = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                texts[out.request_id] = out.outputs[0].text
    # Cut by max_tokens, the text may end inside a character, shown as U+FFFD as
    # tokenizer.decode shows it.
    text = texts["a"].removesuffix("\ufffd")
    assert len(text) > 60 and text in host.TEXT * 5


def test_bench_host_cli_prints_a_table(capsys: pytest.CaptureFixture) -> None:
    main(["bench", "host", "--running", "4", "--mode", "streaming", "--steps", "3"])
    out = capsys.readouterr().out
    assert "us/seq/step" in out and "streaming" in out


def test_constrained_fraction_runs_grammar_masks_every_step() -> None:
    """Half the sequences follow the JSON schema: their masks are computed each step,
    and what they stream stays a prefix of a valid JSON array of strings."""
    result = host.measure(8, "streaming", steps=6, constrained_fraction=0.5)
    assert result.constrained == 4
    assert result.mask_us_per_constrained_seq > 0
    assert result.outputs_per_step == 8  # nobody finished: the array never has to end
    with pytest.raises(ValueError, match="constrained_fraction"):
        host.measure(2, "final", steps=2, constrained_fraction=1.5)


def test_allowed_tokens_keeps_allowed_and_replaces_masked() -> None:
    import numpy as np

    masks = np.zeros((2, 2), np.int32)
    masks[0, 0] = 1 << 5  # row 0 allows token 5 only
    masks[1, :] = -1  # row 1 allows everything
    out = host._allowed_tokens(np.array([7, 40], np.int32), masks)
    assert out.tolist() == [5, 40]
