"""The PEFT loader (:func:`kvpage.lora.load_peft_adapter`): scales as PEFT applies them
(``lora_alpha / r``, rsLoRA's ``/ sqrt(r)``, ``alpha_pattern``), both key spellings, and
adapters kvpage cannot apply exactly refused with the reason."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from kvpage.lora import load_peft_adapter
from kvpage.lora.random_adapter import write_random_adapter
from safetensors.numpy import load_file, save_file

SHAPES = {(0, "q_proj"): (8, 6), (0, "down_proj"): (6, 10), (1, "q_proj"): (8, 6)}


def _adapter(tmp_path: Path, **config: object) -> Path:
    path = write_random_adapter(tmp_path / "a", SHAPES, rank=4, alpha=8.0, seed=3)
    if config:
        data = json.loads((path / "adapter_config.json").read_text())
        data.update(config)
        (path / "adapter_config.json").write_text(json.dumps(data))
    return path


def test_scales_follow_peft(tmp_path: Path) -> None:
    path = _adapter(tmp_path)
    raw = load_file(str(path / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_"
    a, b = load_peft_adapter(path, SHAPES, 16).weights[(0, "q_proj")]
    np.testing.assert_array_equal(a, raw[key + "A.weight"])
    np.testing.assert_allclose(b, raw[key + "B.weight"] * 8.0 / 4)
    rs = load_peft_adapter(_adapter(tmp_path, use_rslora=True), SHAPES, 16)
    np.testing.assert_allclose(rs.weights[(0, "q_proj")][1],
                               raw[key + "B.weight"] * 8.0 / math.sqrt(4), rtol=1e-6)
    pattern = load_peft_adapter(_adapter(tmp_path, alpha_pattern={"down_proj": 2.0}),
                                SHAPES, 16)
    down = "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"
    np.testing.assert_allclose(pattern.weights[(0, "down_proj")][1], raw[down] * 2.0 / 4)
    np.testing.assert_allclose(pattern.weights[(0, "q_proj")][1], raw[key + "B.weight"] * 2)


def test_named_adapter_keys_load_too(tmp_path: Path) -> None:
    path = _adapter(tmp_path)
    raw = load_file(str(path / "adapter_model.safetensors"))
    save_file({k.replace(".weight", ".default.weight"): v for k, v in raw.items()},
              str(path / "adapter_model.safetensors"))
    assert set(load_peft_adapter(path, SHAPES, 16).weights) == set(SHAPES)


@pytest.mark.parametrize(("config", "reason"), [
    ({"use_dora": True}, "DoRA"),
    ({"bias": "lora_only"}, "biases"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out"),
    ({"peft_type": "IA3"}, "not LORA"),
])
def test_adapters_kvpage_cannot_apply_exactly_are_refused(
    tmp_path: Path, config: dict, reason: str
) -> None:
    with pytest.raises(ValueError, match=reason):
        load_peft_adapter(_adapter(tmp_path, **config), SHAPES, 16)


def test_shapes_rank_and_targets_are_checked(tmp_path: Path) -> None:
    path = _adapter(tmp_path)
    with pytest.raises(ValueError, match="max_lora_rank=2"):
        load_peft_adapter(path, SHAPES, 2)
    wrong = dict(SHAPES)
    wrong[(0, "q_proj")] = (8, 7)
    with pytest.raises(ValueError, match=r"must be \[r, 7\]"):
        load_peft_adapter(path, wrong, 16)
    with pytest.raises(ValueError, match="does not have"):
        load_peft_adapter(path, {k: v for k, v in SHAPES.items() if k[0] == 0}, 16)
    (path / "adapter_model.safetensors").unlink()
    with pytest.raises(ValueError, match="adapter_model.safetensors"):
        load_peft_adapter(path, SHAPES, 16)
