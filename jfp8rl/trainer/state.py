"""What a run holds between steps: the `Trainer` (built once), its `Progress` (what a
checkpoint's meta stores besides the arrays) and the sharded train state (params, optimizer
state, calibration state, PRNG key data), fresh or restored from a checkpoint."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jfp8rl.config import Config
from jfp8rl.data.records import Example
from jfp8rl.data.rewards import Reward
from jfp8rl.data.stream import PromptStream
from jfp8rl.data.templates import PromptFormat
from jfp8rl.observe.metrics import MetricsLogger
from jfp8rl.trainer.checkpoint import Checkpointer
from jfp8rl.trainer.overlap import RolloutAhead
from jfp8rl.trainer.policy import Policy
from jfp8rl.trainer.rollout import RolloutSettings
from jfp8rl.trainer.step import StepFns
from jfp8rl.trainer.step_settings import StepSettings
from losses import calibrated as cal
from rollout_bridge.backend import RolloutBackend


@dataclasses.dataclass
class Trainer:
    """What the stages share; built once by `setup`."""

    cfg: Config
    log: Any
    policy: Policy
    backend: RolloutBackend
    fns: StepFns
    mesh: jax.sharding.Mesh
    settings: StepSettings
    ckpt: Checkpointer
    metrics: MetricsLogger
    verifier: Reward  # a built-in verifier or the user's functions
    stream: PromptStream
    eval_set: list[Example]
    fmt: PromptFormat  # prompt / chat template and stop tokens (jfp8rl.data.templates)
    rollout_settings: RolloutSettings
    ref_params: Any  # the base policy (KL loss) or None
    # The batch sampled ahead (`rollout.max_staleness` 1, jfp8rl.trainer.overlap), else None.
    ahead: RolloutAhead | None = None

    @property
    def calibrated(self) -> bool:
        return self.settings.calibrated

    def is_calibration_step(self, step: int) -> bool:
        return self.calibrated and self.settings.calib_cfg.is_calibration_step(step - 1)


@dataclasses.dataclass
class Progress:
    """The run's position: what a checkpoint's meta holds besides the state."""

    step: int = 0
    position: int = 0  # prompts drawn from the stream so far
    nonfinite_run: int = 0  # steps in a row whose updates were all skipped
    carried: dict[str, float] = dataclasses.field(default_factory=dict)  # CALIBRATION_ONLY


def init_state(t: Trainer, params: Any) -> dict[str, Any]:
    """The sharded train state (params, optimizer state, calibration state, PRNG key data)."""
    sh = t.fns.state_shardings(cal.init_calib_state(t.settings.calib_cfg))
    params = jax.device_put(params, sh["params"])
    return {
        "params": params,
        # Initialised in place in its sharding: no full optimizer state on one device.
        "opt_state": jax.jit(t.fns.optimizer.init, out_shardings=sh["opt_state"])(params),
        "calib": jax.device_put(cal.init_calib_state(t.settings.calib_cfg), sh["calib"]),
        # Replicated on the mesh (one global array, also across processes).
        "rng": jax.device_put(
            jax.random.key_data(jax.random.key(t.cfg.train.seed)), t.fns.layout.replicated()
        ),
    }


def build_state(t: Trainer, latest: int | None) -> tuple[dict[str, Any], Progress]:
    """The train state (fresh from the base policy, or checkpoint `latest`) and the run's
    position. The loaded params become the state's (no copy; the policy keeps none, since
    the update donates them); the KL reference, if any, is the only second copy."""
    state = init_state(t, t.policy.params)
    t.policy.params = None
    if t.settings.algo.use_kl_loss:
        copy = jax.jit(lambda x: jax.tree.map(jnp.copy, x), out_shardings=t.fns.layout.params())
        t.ref_params = copy(state["params"])
    if latest is None:
        return state, Progress()
    # Restore into abstract arrays once the fresh state is gone: one state in memory.
    like = jax.tree.map(abstract_array, state)
    del state
    state, meta = t.ckpt.restore(latest, like)
    p = Progress(meta["step"], meta["data_position"], meta["nonfinite_run"], dict(meta["carried"]))
    return state, p


def abstract_array(x: Any) -> Any:
    """An array -> its `jax.ShapeDtypeStruct` with the same sharding (no memory)."""
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))


def buffer_view(x: Any) -> Any:
    """A second `jax.Array` over the same device buffers (no copy), for a reader that leaves
    references behind: orbax's save caches per-shard arrays on the arrays it saves (jax's
    fully-replicated-shard / addressable-shards caches), and a buffer with such a reference
    cannot be donated, so the next update would copy the whole train state. Saving views leaves the state's own arrays
    clean; the views (and their caches) die after the save."""
    if not isinstance(x, jax.Array):
        return x
    shards = [s.data for s in x.addressable_shards]
    return jax.make_array_from_single_device_arrays(x.shape, x.sharding, shards)
