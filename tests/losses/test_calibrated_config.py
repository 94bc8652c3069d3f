"""CalibConfig (losses.calibrated.config): validation names the field."""

from __future__ import annotations

import dataclasses

import pytest
from _loss_testlib import CFG


@pytest.mark.parametrize(
    "bad, field",
    [
        (dict(mode="x"), "mode"),
        (dict(range=(0.9, 1.8)), "range"),
        (dict(ema=1.0), "ema"),
        (dict(balance="x"), "balance"),
        (dict(upper_rule="x"), "upper_rule"),
        (dict(every=0), "every"),
    ],
)
def test_config_validation_names_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(CFG, **bad)


def test_calibration_steps():
    cfg = dataclasses.replace(CFG, every=5)
    assert [s for s in range(12) if cfg.is_calibration_step(s)] == [0, 5, 10]
    assert cfg.plain_bounds == (0.8, 1.28)
