"""The step's memory plan: shows that a configuration fits without the cluster (docs/design.md
section 9). `plan` builds the model of
`model.preset` abstractly (`jax.ShapeDtypeStruct` params, no weights: `model.path` may stay
unset), lowers and compiles `prepare` and `update` ahead of time on the configured mesh with
abstract inputs at the config's real shapes, and prints per device, for each program, the
argument / output / temporary / aliased bytes of `compiled.memory_analysis()`, plus the
analytic state size. Nothing is allocated. It ends with exactly one line:

    plan: <preset> mesh data=D fsdp=F tensor=T micro_batch=M tokens=L: per-device peak X.X GiB (state Y.Y GiB), compiled in Z s

(`tensor=T expert=X` where the mesh has an expert axis of size X > 1.)
peak = max over the programs of (arguments + outputs + temporaries - aliased); state = params
+ optimizer state per device; compiled = lowering + compiling every planned program.

Programs planned: with Calibrated Clipping, the calibrating `prepare` and `update` (a superset
of the plain ones: they add the BF16 shadow forwards); without it, the plain ones.
`prepare` sees the whole step batch (data.batch_size x rollout.n sequences, run micro-batch by
micro-batch), `update` one mini-batch. tokens = data.max_prompt_tokens + rollout.max_tokens.
With token-budget micro-batches (`train.max_tokens_per_micro_batch` B > 0) the update is its
per-bucket programs instead (`token_budget_programs`), and the line says `micro_tokens=B` in
place of `micro_batch=M`.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jfp8rl.config import Config, check_batch_split
from jfp8rl.parallel import mesh as mesh_lib
from jfp8rl.trainer import token_budget
from jfp8rl.trainer.forward import UPDATE_INPUTS, present
from jfp8rl.trainer.settings import step_settings
from jfp8rl.trainer.step import make_step_fns
from losses import calibrated as cal
from models import functional as mf
from models.config import PRESETS

GIB = 2**30


def _fmt(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.2f} MiB"


def bytes_per_device(tree: Any) -> int:
    """Bytes one device holds of a tree of sharded `jax.ShapeDtypeStruct`s (the largest shard)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += int(np.prod(shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
    return total


def abstract_batch(n: int, prompt_len: int, resp_len: int, sharding: Any) -> dict[str, Any]:
    """`prepare`'s input batch (`jfp8rl.data.batch.RolloutBatch` layout) as ShapeDtypeStructs."""
    t = prompt_len + resp_len

    def sds(shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    return {
        "tokens": sds((n, t), jnp.int32),
        "attention_mask": sds((n, t), jnp.int32),
        "prompt_lens": sds((n,), jnp.int32),
        "response_mask": sds((n, resp_len), jnp.float32),
        "rollout_logp": sds((n, resp_len), jnp.float32),
        "rewards": sds((n,), jnp.float32),
        "response_lens": sds((n,), jnp.int32),
    }


def _with_sharding(tree: Any, shardings: Any) -> Any:
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


def token_budget_programs(
    fns: Any,
    settings: Any,
    state: dict[str, Any],
    mb: dict[str, Any],
    on_policy: Any,
    resp_len: int,
) -> dict[str, tuple[Any, tuple[Any, ...], int]]:
    """The token-budget update's programs (`jfp8rl.trainer.token_budget`) at their real shapes:
    per bucket L the micro-batch of ranks x (budget // L) rows (the calibrating no-gradient
    forward and the forward/backward), then the whole mini-batch's bounds and finishing update.
    The micro-batch programs do not take the optimizer state and the mini-batch, which stay on
    the device meanwhile: their bytes are added to those programs' peaks as `resident`."""
    tb, layout = fns.token_budget, fns.layout
    dat, rep = layout.batch(), layout.replicated()
    ranks = mesh_lib.batch_size_divisor(layout.mesh)
    calibrate = settings.calibrated
    resident = bytes_per_device(state["opt_state"]) + bytes_per_device(mb)
    scalar = jax.ShapeDtypeStruct((), jnp.float32, sharding=rep)
    grads = state["params"]  # the accumulator: f32, in the params' sharding
    out: dict[str, tuple[Any, tuple[Any, ...], int]] = {}
    for length in settings.length_buckets:
        rows = ranks * (settings.max_tokens_per_micro_batch // length)
        width = {"tokens": length, "attention_mask": length}
        m = {
            k: jax.ShapeDtypeStruct((rows, *((width.get(k, min(length, resp_len)),)
                                             if mb[k].ndim == 2 else ())), mb[k].dtype,
                                    sharding=dat)
            for k in token_budget.MICRO_INPUTS if k in mb
        }  # fmt: skip
        pre = {k: m[k] for k in token_budget.PRE_INPUTS}
        if calibrate:
            out[f"pre L={length}"] = (tb.pre, (state["params"], pre, True), resident)
        # (params, acc, micro, lo, hi, den, counted tokens of an MoE balancing loss, resp_len)
        args = (state["params"], grads, m, scalar, scalar, scalar, scalar, resp_len)
        out[f"micro L={length}"] = (tb.micro, args, resident)
    logp = jax.ShapeDtypeStruct(mb["response_mask"].shape, jnp.float32, sharding=dat)
    bounds_args = (state["calib"], logp if calibrate else None, logp if calibrate else None, mb,
                   on_policy, calibrate)  # fmt: skip
    with fns.mesh_context():
        calib, lo, hi, aux, _ = tb.bounds.lower(*bounds_args).out_info
    state_bytes = bytes_per_device(state["params"]) + bytes_per_device(state["opt_state"])
    out["bounds"] = (tb.bounds, bounds_args, state_bytes)
    out["finish"] = (tb.finish, (state, grads, calib, lo, hi, aux, mb, logp, logp), 0)
    return out


def plan(cfg: Config, log: Any = print, num_layers: int | None = None) -> dict[str, Any]:
    """Compiles the step's programs for `cfg` abstractly; returns (and logs) the numbers.
    `num_layers` overrides the preset's depth (to show compile time does not grow with it)."""
    m = cfg.model
    mcfg = PRESETS[m.preset].replace(
        compute_dtype=jnp.dtype(m.compute_dtype), remat=m.remat, attention=m.attention
    )
    if num_layers:
        mcfg = mcfg.replace(num_layers=num_layers)
    graphdef, params = mf.abstract_model(mcfg)
    mesh = mesh_lib.mesh_for_config(cfg.train.mesh)  # the trainer's mesh, expert axis included
    check_batch_split(cfg, mesh_lib.batch_size_divisor(mesh))
    layout = mesh_lib.param_layout(mesh, mcfg, params)
    settings, opt = step_settings(cfg)
    fns = make_step_fns(graphdef, settings, opt, layout)
    calibrate = settings.calibrated
    state_sh = fns.state_shardings(cal.init_calib_state(settings.calib_cfg))
    state = {
        "params": _with_sharding(params, state_sh["params"]),
        "opt_state": _with_sharding(
            jax.eval_shape(fns.optimizer.init, params), state_sh["opt_state"]
        ),
        "calib": _with_sharding(
            jax.eval_shape(lambda: cal.init_calib_state(settings.calib_cfg)), state_sh["calib"]
        ),
    }
    ref = state["params"] if settings.algo.use_kl_loss else None
    prompt_len, resp_len = cfg.data.max_prompt_tokens, cfg.rollout.max_tokens
    n_step = cfg.data.batch_size * cfg.rollout.n
    batch = abstract_batch(n_step, prompt_len, resp_len, layout.batch())
    mini = abstract_batch(cfg.mini_batch_size, prompt_len, resp_len, layout.batch())
    with fns.mesh_context():
        prep_out, _ = jax.eval_shape(fns.prepare_programs[calibrate], state["params"], ref, mini)
    mb = present(mini, UPDATE_INPUTS) | _with_sharding(
        prep_out, jax.tree.map(lambda _: layout.batch(), prep_out)
    )
    on_policy = jax.ShapeDtypeStruct((), jnp.bool_, sharding=layout.replicated())

    n_params = sum(x.size for x in jax.tree.leaves(params))
    state_bytes = bytes_per_device(state["params"]) + bytes_per_device(state["opt_state"])
    shape = dict(mesh.shape)
    log(
        f"model {m.preset}: {n_params / 1e9:.3f} B params, {mcfg.num_layers} layers, "
        f"remat={mcfg.remat}, attention={mcfg.attention}; mesh {shape} on "
        f"{mesh.devices.size} {jax.devices()[0].platform} devices"
    )
    shards = shape["fsdp"] * shape["expert"] * shape["tensor"]  # every param, where all divide
    log(
        f"state per device: params {_fmt(bytes_per_device(state['params']))}, optimizer state "
        f"{_fmt(bytes_per_device(state['opt_state']))}, total {_fmt(state_bytes)} "
        f"(12 B x params / {shards} = {_fmt(12 * n_params / shards)})"
    )
    # name -> (jitted program, its arguments, bytes that stay on the device meanwhile)
    programs = {"prepare": (fns.prepare_programs[calibrate], (state["params"], ref, batch), 0)}
    if fns.token_budget is None:
        programs["update"] = (fns.update_programs[calibrate], (state, mb, on_policy), 0)
    else:
        programs |= token_budget_programs(fns, settings, state, mb, on_policy, resp_len)
    kind = "calibrating" if calibrate else "plain"
    results: dict[str, dict[str, float]] = {}
    compile_s = 0.0
    for name, (fn, args, resident) in programs.items():
        log(f"compiling {name} ({kind}) ...")
        t0, c0 = time.perf_counter(), time.process_time()
        with fns.mesh_context():
            compiled = fn.lower(*args).compile()
        # CPU seconds too: on a shared machine the wall time mostly measures the neighbours.
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        compile_s += dt
        ma = compiled.memory_analysis()
        r = {
            "arguments": ma.argument_size_in_bytes,
            "outputs": ma.output_size_in_bytes,
            "temporaries": ma.temp_size_in_bytes,
            "aliased": ma.alias_size_in_bytes,
            "resident": resident,
        }
        r["peak"] = r["arguments"] + r["outputs"] + r["temporaries"] - r["aliased"] + resident
        r["compile_s"], r["compile_cpu_s"] = dt, cpu
        results[name] = r
        log(
            f"  {name} ({kind}) per device: arguments {_fmt(r['arguments'])}, outputs "
            f"{_fmt(r['outputs'])}, temporaries {_fmt(r['temporaries'])}, aliased "
            f"{_fmt(r['aliased'])}{f', resident {_fmt(resident)}' if resident else ''} -> peak {_fmt(r['peak'])}; compiled in {dt:.1f} s "
            f"({cpu:.1f} s CPU)"
        )
    peak = max(r["peak"] for r in results.values())
    micro = f"micro_batch={cfg.train.micro_batch_size or cfg.mini_batch_size}"
    if fns.token_budget is not None:
        micro = f"micro_tokens={settings.max_tokens_per_micro_batch}"
    expert = f" expert={shape['expert']}" if shape["expert"] > 1 else ""
    line = (
        f"plan: {m.preset} mesh data={shape['data']} fsdp={shape['fsdp']} "
        f"tensor={shape['tensor']}{expert} {micro} tokens={prompt_len + resp_len}: "
        f"per-device peak {peak / GIB:.1f} GiB (state {state_bytes / GIB:.1f} GiB), "
        f"compiled in {compile_s:.0f} s"
    )
    log(line)
    return {
        "programs": results,
        "peak_bytes": peak,
        "state_bytes": state_bytes,
        "n_params": n_params,
        "compile_s": compile_s,
        "line": line,
    }
