"""FP8 recipes (models.fp8.recipe): the registry, overrides, and validation that names the field."""

from __future__ import annotations

import pytest

from models import fp8


def test_registry_maps_each_name_to_its_recipe():
    assert list(fp8.RECIPES) == ["bf16", "fp8_tensor", "fp8_row", "fp8_block"]
    for name, recipe in fp8.RECIPES.items():
        assert recipe.name == name and fp8.get_recipe(name) is recipe
    assert not fp8.BF16.quantized and fp8.FP8_BLOCK.quantized


def test_overrides_make_a_new_recipe():
    r = fp8.get_recipe("fp8_block", bwd_format="e5m2", pow2_scales=True)
    assert (r.bwd_format, r.pow2_scales, r.block_size) == ("e5m2", True, 128)
    assert fp8.FP8_BLOCK.bwd_format == "e4m3"  # the preset is unchanged


def test_unknown_recipe_names_choices():
    with pytest.raises(ValueError, match="fp8_block"):
        fp8.get_recipe("fp8_blocks")


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(act_granularity="col"), "act_granularity"),
        (dict(fwd_format="e3m4"), "fwd_format"),
        (dict(block_size=0), "block_size"),
        (dict(backend="triton"), "backend"),
        (dict(backend="pallas", prequantized_weights=True), "prequantized_weights"),
    ],
)
def test_invalid_fields_are_named(overrides, match):
    with pytest.raises(ValueError, match=match):
        fp8.get_recipe("fp8_block", **overrides)


@pytest.mark.parametrize("name", ["fp8_tensor", "fp8_row"])
def test_pallas_refuses_non_block_recipes(name):
    with pytest.raises(ValueError, match=rf"{name}.*backend='emulate'"):
        fp8.get_recipe(name, backend="pallas")
    with pytest.raises(ValueError, match="block_size 128"):
        fp8.get_recipe("fp8_block", backend="pallas", block_size=64)
