"""Where the rollout-vs-trainer mismatch comes from (`python -m jfp8rl.mismatch`).

`rollout_corr/kl` is the trainer's estimator of KL(rollout || trainer) on the sampled tokens:
the mean over response tokens of `rollout_logp - old_logp` (k1, `losses.rollout_correction.
mismatch_metrics`). For one rollout batch of the configured policy and each (rollout recipe R,
trainer recipe S) pairing, with the same weights on both sides, this module reports that figure
as the trainer computes it (the trainer's own `prepare` program) and splits it into sources
along a chain of log-probabilities of the same tokens:

    rollout_logp   the engine's: the weights as the run's push delivers them, KV-cache
                   prefill + one-token decode steps, the engine's batch (rows and prompt
                   padding of its bucket), recipe R, logits / T
    whole_R        one full teacher-forced forward of the whole batch (the trainer's layout),
                   recipe R, logits / T
    old_R          the trainer's `prepare` (its micro-batches), recipe R, logits / T
    old_S          the trainer's `prepare`, recipe S: the trainer's old_logp of the pairing

k1 is a mean of differences, so it telescopes exactly:

    rollout_corr/kl(R, S) = k1(rollout_logp, whole_R)   "decode": the engine vs the full
                                                         forward (served weights, shapes,
                                                         attention kernel, summation order)
                          + k1(whole_R, old_R)          "batch": the same forward in the
                                                         trainer's micro-batches (row count
                                                         changes XLA's summation order and a
                                                         per-tensor scale's amax)
                          + k1(old_R, old_S)            "recipe": a different trainer recipe

With FP8 recipes the first two terms are where float32 rounding noise flips FP8 roundings (one
E4M3 step is 2^-3 relative, against 2^-24 of a float32 ulp), so they measure the amplification
of summation order by FP8; the same terms of the bf16 recipe are the noise without it. The
`ulp_*` columns measure that amplification directly: the whole-batch forward of recipe R with
every parameter nudged by about one float32 ulp (`nudged`) against the same forward without.
Each term also carries its k3 (`rollout_corr/k3_kl`), the mean and largest |difference| of the
token log-probabilities and the share of tokens where the two agree bit for bit.

The sampling transform: the trainer scores at logits / `rollout.temperature`, as the engine
samples. `temperature_k1` is what scoring at temperature 1 instead would add (the whole-batch
forward of recipe S at temperature 1 against the same at T; 0 when T is 1). Other sources are
whole runs of the command with one setting changed, so the rows of the runs compare like with
like: the compute dtype (`model.compute_dtype=bfloat16`), the weight-push format
(`rollout.export_format=fp32` against the block recipe's default FP8 checkpoint, whose
norms and embeddings travel in bf16), power-of-two scales (`RECIPE+pow2` in a pairing, both
sides) and exact on-policy rollouts (`rollout.on_policy=exact`: batch-invariant numerics on both
sides, every term 0). `requantization_drift` measures the weight side of the push directly.
The trainer's old log-probs are always recomputed here, also where the run itself would take
the rollout's.

Mixture-of-Experts policies add a routing term: the engine records each token's experts
(`rollout.routing_replay`), and each row gains the share of (token, layer) pairs whose expert set
the trainer's router picks differently on the same weights (`routing_mismatch`), and the
trainer's k1 with the rollout's routing replayed and with its own routing (`kl_routing_replay`,
`kl_own_routing`). The chain above scores the way the configured run does (replayed with
`rollout.routing_replay: record`, else its own routing).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jfp8rl.analysis.tables import markdown_table
from jfp8rl.config import ConfigError, load_config
from jfp8rl.data.batch import RolloutBatch
from jfp8rl.observe.memory import objects_before_frozen
from jfp8rl.parallel import mesh as mesh_lib
from jfp8rl.trainer.backends import push_format
from jfp8rl.trainer.forward import gather_response
from jfp8rl.trainer.loop import setup
from jfp8rl.trainer.settings import step_settings
from jfp8rl.trainer.stages import stage_prepare, stage_rollout, stage_sync
from jfp8rl.trainer.state import Progress, Trainer
from jfp8rl.trainer.step import make_step_fns
from losses.rollout_correction import mismatch_metrics
from models import fp8
from models import functional as mf
from models.fp8 import RECIPES, Recipe, get_recipe
from rollout_bridge.engine.embedded import EmbeddedBackend
from rollout_bridge.engine.params import kernel_paths, node
from rollout_bridge.engine.programs import install_layer

# The pairings of the study: (rollout recipe, trainer recipe).
PAIRINGS: tuple[tuple[str, str], ...] = (
    ("bf16", "bf16"),
    ("fp8_block", "fp8_block"),
    ("fp8_tensor", "fp8_tensor"),
    ("fp8_block", "bf16"),
    ("fp8_tensor", "bf16"),
)
TERMS = ("decode", "batch", "recipe")
POW2 = "+pow2"

# Markdown columns: (header, row key, format).
COLUMNS = (
    ("rollout", "rollout_recipe", "s"),
    ("trainer", "train_recipe", "s"),
    ("rollout_corr/kl (trainer)", "rollout_corr/kl", ".2e"),
    ("k3", "rollout_corr/k3_kl", ".2e"),
    ("decode k1", "decode_k1", ".2e"),
    ("batch k1", "batch_k1", ".2e"),
    ("recipe k1", "recipe_k1", ".2e"),
    ("sum of terms", "sum_k1", ".2e"),
    ("decode k3", "decode_k3", ".2e"),
    ("batch k3", "batch_k3", ".2e"),
    ("recipe k3", "recipe_k3", ".2e"),
    ("decode mean abs", "decode_abs_mean", ".2e"),
    ("batch mean abs", "batch_abs_mean", ".2e"),
    ("recipe mean abs", "recipe_abs_mean", ".2e"),
    ("decode exact share", "decode_exact_share", ".3f"),
    ("batch exact share", "batch_exact_share", ".3f"),
    ("1-ulp nudge k1", "ulp_k1", ".2e"),
    ("1-ulp nudge mean abs", "ulp_abs_mean", ".2e"),
    ("temperature k1", "temperature_k1", ".2e"),
    ("tokens", "tokens", "d"),
)
# Mixture-of-Experts rows only (`measure`): the routing term.
MOE_COLUMNS = (
    ("routing mismatch", "routing_mismatch", ".4f"),
    ("k1 routing replayed", "kl_routing_replay", ".2e"),
    ("k1 own routing", "kl_own_routing", ".2e"),
)


def parse_recipe(spec: str) -> Recipe:
    """A recipe name of `models.fp8.RECIPES`, optionally with `+pow2` (power-of-two scales,
    UE8M0): "fp8_block", "fp8_block+pow2"."""
    name = spec.removesuffix(POW2)
    if name not in RECIPES or (spec.endswith(POW2) and not RECIPES[name].quantized):
        raise ConfigError(
            f"recipe {spec!r}: expected one of {sorted(RECIPES)}, an FP8 one optionally with "
            f"'{POW2}' (e.g. fp8_block{POW2})"
        )
    recipe = get_recipe(name)
    if spec.endswith(POW2):
        recipe = dataclasses.replace(recipe, name=spec, pow2_scales=True)
    return recipe


def parse_pairings(text: str) -> tuple[tuple[str, str], ...]:
    """ "R/S,R/S" -> ((R, S), ...), each side checked by `parse_recipe`."""
    out = []
    for item in text.split(","):
        parts = item.strip().split("/")
        if len(parts) != 2:
            raise ConfigError(f"--pairings {item!r}: write ROLLOUT/TRAINER, e.g. fp8_block/bf16")
        for p in parts:
            parse_recipe(p)
        out.append((parts[0], parts[1]))
    return tuple(out)


def term(a: np.ndarray, b: np.ndarray, mask: np.ndarray) -> dict[str, float]:
    """One link of the chain: log-probabilities `a` (the rollout side) against `b` (the trainer
    side) of the same tokens, [N, R] with response mask `mask`. k1 and k3 are the trainer's
    `rollout_corr/kl` and `rollout_corr/k3_kl` of (rollout = a, trainer = b); `abs_mean` /
    `abs_max` of |a - b| and `exact_share`, the share of tokens with a == b, in float64."""
    m = jax.device_get(mismatch_metrics(jnp.asarray(b), jnp.asarray(a), jnp.asarray(mask)))
    on = np.asarray(mask) > 0
    d = np.asarray(a, np.float64)[on] - np.asarray(b, np.float64)[on]
    n = max(d.size, 1)
    return {
        "k1": float(m["rollout_corr/kl"]),
        "k3": float(m["rollout_corr/k3_kl"]),
        "abs_mean": float(np.sum(np.abs(d)) / n),
        "abs_max": float(np.max(np.abs(d))) if d.size else 0.0,
        "exact_share": float(np.sum(d == 0) / n),
    }


def split_row(
    rollout_logp: np.ndarray,
    whole_r: np.ndarray,
    old_r: np.ndarray,
    old_s: np.ndarray,
    mask: np.ndarray,
) -> dict[str, float]:
    """The row keys `<term>_<stat>` of the chain rollout_logp -> whole_R -> old_R -> old_S
    (module docstring) and `sum_k1`, their k1 sum."""
    row: dict[str, float] = {}
    links = zip(TERMS, (rollout_logp, whole_r, old_r), (whole_r, old_r, old_s), strict=True)
    for name, a, b in links:
        row |= {f"{name}_{k}": v for k, v in term(a, b, mask).items()}
    row["sum_k1"] = sum(row[f"{t}_k1"] for t in TERMS)
    return row


def requantization_drift(cfg: Any, params: Any, recipe: Recipe) -> dict[str, float]:
    """What the block recipe's FP8 weight push does to the weights the engine computes with.

    The push exports each decoder kernel as (q, s) = `fp8.quantize_weight` (the trainer's
    quantizer), so q * s is exactly the trainer's operand. `installed_exact` is the share of
    layers whose kernel the engine installs (`programs.install_layer`) equal to the trainer's
    operand everywhere (1.0: the engine installs q * s as it is). The other two shares say what
    quantizing the push again would do instead (its scale re-derived from amax = 448 * s, and
    amax * (1/448) is not always s): the share of block scales that would move and of weight
    values that would change."""
    tile = fp8.weight_tile(recipe)  # square blocks: the same tile on the [in, out] kernel
    n_w = n_w_moved = n_s = n_s_moved = exact = layers = 0
    for path in kernel_paths(cfg):
        w = node(params, path).get_value()
        for w_l in w.reshape(-1, *w.shape[-2:]):  # per layer: [in, out]
            operand = fp8.fake_quantize_weight(w_l, recipe)
            q, s = fp8.quantize_weight(w_l.T, recipe)
            pushed = fp8.StoredFP8Weight(q.T, s.T, tile)
            installed = install_layer(pushed, recipe=recipe, dtype=jnp.float32)
            w_pushed = fp8.dense_weights(pushed)
            again = fp8.fake_quantize_weight(w_pushed, recipe)
            n_w += operand.size
            n_w_moved += int(jnp.sum(again != operand))
            n_s += s.size
            n_s_moved += int(jnp.sum(fp8.quantize_weight(w_pushed.T, recipe)[1] != s))
            exact += int(bool(jnp.all(installed == operand)))
            layers += 1
    return {
        "installed_exact": exact / max(layers, 1),
        "requantize_scales_moved_share": n_s_moved / max(n_s, 1),
        "requantize_weights_changed_share": n_w_moved / max(n_w, 1),
    }


@functools.partial(jax.jit, static_argnums=0, static_argnames=("recipe", "temperature", "resp"))
def _whole_logp(graphdef, params, tokens, mask, prompt_lens, routing, *, recipe, temperature, resp):
    """Response-aligned [N, R] log-probabilities of one full forward over every row at once
    (`routing`: an MoE batch's recorded experts to replay, or None)."""
    lp = mf.token_logprobs(
        graphdef, params, tokens, mask, recipe=recipe, temperature=temperature, routing=routing
    )
    return gather_response(lp, prompt_lens, resp)


def nudged(params: Any) -> Any:
    """`params` with every float multiplied by 1 + 2^-22 (one or two float32 ulps): the
    `ulp_*` columns compare the whole-batch forward of these with that of `params`, how far a
    float32 perturbation alone moves the recipe's log-probabilities (FP8 rounds it into
    whole E4M3 steps wherever it crosses a rounding boundary)."""

    def one(x: Any) -> Any:
        if not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        return (x.astype(jnp.float32) * jnp.float32(1.0 + 2.0**-22)).astype(x.dtype)

    return jax.tree.map(one, params)


def whole_logp(t: Trainer, params: Any, batch: RolloutBatch, recipe: Recipe, temp: float):
    """`_whole_logp` of `batch` on host (float32)."""
    routing = None if batch.routing is None else jnp.asarray(batch.routing)
    out = _whole_logp(
        t.policy.graphdef, params, jnp.asarray(batch.tokens), jnp.asarray(batch.attention_mask),
        jnp.asarray(batch.prompt_lens), routing, recipe=recipe, temperature=float(temp),
        resp=batch.response_mask.shape[1],
    )  # fmt: skip
    return np.where(batch.response_mask > 0, np.asarray(out), 0.0)


def sample(t: Trainer, state: dict[str, Any], recipe: Recipe) -> RolloutBatch:
    """Step 1's rollout batch (the configured prompts, seed and sampling) from an embedded
    engine of `recipe`, loaded by the run's own weight push (`stage_sync`; the push format a
    run with `rollout.recipe` = `recipe` uses); every recipe samples from the same prompts
    and seeds. Its response mask covers every sampled token; an MoE engine records the
    routing."""
    r = t.cfg.rollout
    # An FP8 checkpoint holds the preset's scales: a +pow2 engine takes fp32 weights and
    # quantizes them itself, as the trainer does.
    fmt = r.export_format or ("fp32" if recipe.pow2_scales else "")
    r = dataclasses.replace(r, recipe=recipe.name.removesuffix(POW2), export_format=fmt)
    backend = EmbeddedBackend(
        t.policy.cfg, t.policy.graphdef, None, recipe=recipe, eos_id=t.policy.stop_ids,
        weight_version="base", export_format=push_format(r), max_num_seqs=r.max_num_seqs,
        kv_cache_dtype=r.kv_cache_dtype, record_routing=t.policy.cfg.is_moe,
    )  # fmt: skip
    # The trainer's recipe follows (`rollout.on_policy: exact` holds only for equal recipes);
    # sampling and the push do not use it.
    train = dataclasses.replace(t.cfg.train, recipe=r.recipe)
    # An MoE engine records the routing and the batch carries it (`measure`'s routing term).
    packing = dataclasses.replace(t.rollout_settings, routing_replay=t.policy.cfg.is_moe)
    tr = dataclasses.replace(
        t, backend=backend, cfg=dataclasses.replace(t.cfg, rollout=r, train=train),
        rollout_settings=packing,
    )  # fmt: skip
    try:
        stage_sync(tr, state, 0)
        batch, _ = stage_rollout(tr, Progress(), 1)
    finally:
        backend.close()
    # Every sampled token, as `rollout_corr/kl` counts them (also groups left out of the loss).
    resp = batch.response_mask.shape[1]
    valid = np.arange(resp)[None, :] < batch.response_lens[:, None]
    return dataclasses.replace(batch, response_mask=valid.astype(np.float32))


class Prepared:
    """The trainer's `prepare` per trainer recipe, compiled once each: (old_logp [N, R], its
    metrics) of a batch, as the trainer computes them (micro-batches, logits / T)."""

    def __init__(self, t: Trainer, state: dict[str, Any]):
        self.t, self.state, self.fns = t, state, {}

    def __call__(self, recipe: Recipe, batch: RolloutBatch) -> tuple[np.ndarray, dict]:
        t = self.t
        if recipe.name not in self.fns:
            settings, opt = step_settings(t.cfg)
            # The recompute is what is measured, also where the run itself would take the
            # rollout's log-probs (`rollout.on_policy: exact`).
            settings = settings._replace(
                train_recipe=recipe, calibrated=False, old_logp_from_rollout=False
            )
            layout = mesh_lib.param_layout(t.mesh, t.policy.cfg, self.state["params"])
            fns = make_step_fns(t.policy.graphdef, settings, opt, layout)
            self.fns[recipe.name] = dataclasses.replace(t, fns=fns, settings=settings)
        full, mets = stage_prepare(self.fns[recipe.name], self.state, batch, False)
        return np.where(batch.response_mask > 0, full["old_logp"], 0.0), mets


def measure(
    t: Trainer,
    state: dict[str, Any],
    pairings: tuple[tuple[str, str], ...],
    log: Any = print,
    arrays: dict[str, np.ndarray] | None = None,
) -> list[dict[str, Any]]:
    """One row per pairing (module docstring); each rollout recipe samples once. `arrays`, if
    given, receives the chain's [N, R] arrays by name: `R/mask`, `R/rollout_logp`, `R/whole`,
    `R/old/S` (float32, 0 off the mask)."""
    keep = arrays if arrays is not None else {}
    t0 = time.perf_counter()
    temp = t.cfg.rollout.temperature
    params = state["params"]
    prepared = Prepared(t, state)
    rows = []
    replay = t.cfg.rollout.routing_replay == "record"
    for rspec in dict.fromkeys(r for r, _ in pairings):
        rec_r = parse_recipe(rspec)
        recorded = sample(t, state, rec_r)
        # The chain scores as the run does: the recorded routing replayed, or its own.
        batch = recorded if replay else dataclasses.replace(recorded, routing=None)
        mask = batch.response_mask
        whole_r = whole_logp(t, params, batch, rec_r, temp)
        ulp = term(whole_r, whole_logp(t, nudged(params), batch, rec_r, temp), mask)
        old_r, _ = prepared(rec_r, batch)
        keep |= {f"{rspec}/mask": mask, f"{rspec}/rollout_logp": batch.rollout_logp,
                 f"{rspec}/whole": whole_r}  # fmt: skip
        log(f"[mismatch] rollout {rspec}: {int(mask.sum())} response tokens sampled and "
            f"scored ({time.perf_counter() - t0:.0f} s)")  # fmt: skip
        for _, sspec in [p for p in pairings if p[0] == rspec]:
            rec_s = parse_recipe(sspec)
            old_s, mets = prepared(rec_s, batch)
            keep[f"{rspec}/old/{sspec}"] = old_s
            row: dict[str, Any] = {"rollout_recipe": rspec, "train_recipe": sspec}
            row["rollout_corr/kl"] = mets["rollout_corr/kl"]
            row["rollout_corr/k3_kl"] = mets["rollout_corr/k3_kl"]
            row |= split_row(batch.rollout_logp, whole_r, old_r, old_s, mask)
            row |= {"ulp_k1": ulp["k1"], "ulp_abs_mean": ulp["abs_mean"]}
            row["temperature_k1"] = 0.0
            if temp != 1.0:  # what scoring at temperature 1 (not T) would add
                whole_s = whole_logp(t, params, batch, rec_s, temp)
                whole_s1 = whole_logp(t, params, batch, rec_s, 1.0)
                row["temperature_k1"] = term(whole_s, whole_s1, mask)["k1"]
            if recorded.routing is not None:
                row |= routing_term(prepared, rec_s, recorded)
            row["tokens"] = int(mask.sum())
            row["temperature"] = temp
            rows.append(row)
            took = time.perf_counter() - t0
            eta = took / len(rows) * (len(pairings) - len(rows))
            log(f"[mismatch] {rspec}/{sspec}: rollout_corr/kl {row['rollout_corr/kl']:.3e} "
                f"({len(rows)}/{len(pairings)}, {took:.0f} s, ETA {eta:.0f} s)")  # fmt: skip
    return rows


def routing_term(prepared: Prepared, recipe: Recipe, recorded: RolloutBatch) -> dict[str, float]:
    """An MoE batch's routing term (module docstring): the trainer's `prepare` with the
    recorded routing replayed (its routing-mismatch share and k1) and with its own."""
    _, replayed = prepared(recipe, recorded)
    _, own = prepared(recipe, dataclasses.replace(recorded, routing=None))
    return {
        "routing_mismatch": replayed["rollout_corr/routing_mismatch"],
        "kl_routing_replay": replayed["rollout_corr/kl"],
        "kl_own_routing": own["rollout_corr/kl"],
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as one markdown table (COLUMNS, and MOE_COLUMNS when a row has them)."""
    cols = COLUMNS + (MOE_COLUMNS if any("routing_mismatch" in r for r in rows) else ())
    return markdown_table(
        [h for h, _, _ in cols],
        ([format(r[k], f) if k in r else "-" for _, k, f in cols] for r in rows),
    )


@objects_before_frozen()  # the stages' collections walk this call's objects only
def run_mismatch(
    config: str,
    overrides: list[str],
    out: str | Path,
    pairings: tuple[tuple[str, str], ...] = PAIRINGS,
    log: Any = print,
) -> list[dict[str, Any]]:
    """The measurement on the configured base policy; writes `out/mismatch.json`,
    `out/mismatch.md` (a header line naming the config, the batch and the time, then the
    table) and `out/arrays.npz` (the chain's arrays, `measure`) and returns the rows."""
    t0 = time.perf_counter()
    out = Path(out)
    sets = [*overrides, f"run_dir={out / 'run'}", "logging.console=none",
            "logging.tensorboard=false"]  # fmt: skip
    cfg = load_config(config, sets)
    t, state, _ = setup(cfg, None, log, sys.stderr)
    try:
        t.backend.close()  # each rollout recipe gets its own engine (`sample`)
        arrays: dict[str, np.ndarray] = {}
        rows = measure(t, state, pairings, log, arrays)
        drift = requantization_drift(t.policy.cfg, state["params"], get_recipe("fp8_block"))
    finally:
        t.ckpt.close()
        t.metrics.close()
    out.mkdir(parents=True, exist_ok=True)
    r = cfg.rollout
    header = (
        f"mismatch: {config} {' '.join(overrides)}; one rollout batch per rollout recipe, "
        f"{cfg.data.batch_size} prompts x {r.n} samples, max_tokens {r.max_tokens}, "
        f"temperature {r.temperature}, compute dtype {jnp.dtype(t.policy.cfg.compute_dtype).name}, "
        f"push format {push_format(r) or 'the recipe default'}, kv cache {r.kv_cache_dtype}; "
        f"{time.perf_counter() - t0:.0f} s"
    )
    header += (
        f"\n\nfp8_block weight push: the engine installs the trainer's operand bit for bit in "
        f"{drift['installed_exact']:.3f} of layers (quantizing the push again instead would move "
        f"{drift['requantize_scales_moved_share']:.3f} of block scales and change "
        f"{drift['requantize_weights_changed_share']:.3f} of weight values)"
    )
    (out / "requantization.json").write_text(json.dumps(drift, indent=1) + "\n")
    (out / "mismatch.json").write_text(json.dumps(rows, indent=1) + "\n")
    np.savez_compressed(out / "arrays.npz", **arrays)
    (out / "mismatch.md").write_text(header + "\n\n" + markdown(rows))
    return rows
