import sys, time, statistics
import jax.numpy as jnp, numpy as np
import rollout_bridge
from rollout_bridge.backend import SamplingParams
from rollout_bridge.engine.embedded import EmbeddedBackend
rng = np.random.default_rng(0)
prompts = [rng.integers(32, 127, size=int(rng.integers(24, 49))).tolist() for _ in range(36)]
for recipe in ("fp8_block", "bf16"):
    eng = EmbeddedBackend.from_hf_dir("/root/.cache/jfp8rl/smollm2-135m-instruct", recipe=recipe,
        config_overrides={"compute_dtype": jnp.float32}, max_len=1024)
    ts = []
    for r in range(3):
        t0 = time.perf_counter()
        eng.generate(prompts, SamplingParams(max_tokens=32, temperature=1.0, seed=r, ignore_eos=True))
        ts.append(time.perf_counter() - t0)
    print(rollout_bridge.__file__.split("/")[2], recipe, "warmup %.1f" % ts[0], "timed", ["%.1f" % t for t in ts[1:]], flush=True)
