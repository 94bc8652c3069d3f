"""The `rollout` section of the run configuration: where samples come from (the embedded
engine or HTTP servers), how they are sampled, how weights reach the servers, and how far the
rollout may run ahead of the update. Checked like the other sections (`sections`)."""

from __future__ import annotations

import dataclasses
from dataclasses import field

from jfp8rl.config.checks import ConfigError, check_choice, check_positive
from models.fp8 import RECIPES
from models.kv_quant import KV_CACHE_DTYPES
from rollout_bridge.engine.batching import DEFAULT_MAX_NUM_SEQS
from rollout_bridge.weights.hashing import HASHES

DEFAULT_ROLLOUT_URL = "http://127.0.0.1:8000"
# Read for the rollout servers' API key when rollout.api_key is empty.
API_KEY_ENV = "JFP8RL_ROLLOUT_API_KEY"
# rollout.max_staleness values the trainer implements (jfp8rl.trainer.overlap).
MAX_STALENESS = (0, 1)
# rollout.on_policy values, and the recipes "exact" runs bit-identically (models.invariant).
ON_POLICY = ("off", "exact")
EXACT_RECIPES = ("bf16", "fp8_block")
# rollout.routing_replay values (Mixture-of-Experts models).
ROUTING_REPLAY = ("off", "record")


def check_exact_on_policy(rollout: RolloutConfig, train_recipe: str, tensor: int) -> None:
    """The cross-section conditions of `rollout.on_policy: exact` (the rollout section checks
    its own): the trainer runs the rollout's recipe, and no tensor-parallel layer splits a
    GEMM's sum over devices."""
    if rollout.on_policy != "exact":
        return
    if train_recipe != rollout.recipe:
        raise ConfigError(
            f"rollout.on_policy=exact cannot hold with train.recipe={train_recipe} and "
            f"rollout.recipe={rollout.recipe}: set both to the same recipe"
        )
    if tensor != 1:
        raise ConfigError(
            f"rollout.on_policy=exact cannot hold with train.mesh.tensor={tensor} (a "
            "tensor-parallel all-reduce sums partial products in shard order): use tensor=1"
        )


@dataclasses.dataclass
class RolloutConfig:
    # "embedded": in-process JAX engine; "http": a vLLM or `python -m rollout_bridge.serve`.
    backend: str = "embedded"
    # The one server of backend "http" (empty: http://127.0.0.1:8000 unless `urls` is given).
    url: str = ""
    # Several servers (backend "http"): prompt groups spread over them by load, weights
    # pushed to all, a failing server dropped (rollout_bridge.client.pool). Give `url` or `urls`.
    urls: list[str] = field(default_factory=list)
    # Folder the trainer writes weight exports to and the servers read them from: a
    # filesystem every server can read (/dev/shm only when they share this host). Empty: the
    # default (/dev/shm/jfp8rl/run-<pid>, or $JFP8RL_EXPORT_ROOT).
    export_root: str = ""
    # API key of the HTTP servers (their --api-key), sent as `Authorization: Bearer <key>` to
    # every server of rollout.url(s); empty: $JFP8RL_ROLLOUT_API_KEY, else none. Never written
    # to <run_dir>/config.yaml or a checkpoint (`jfp8rl.config.loading.to_yaml`), so give it by
    # the environment variable: a resume from the saved config finds it there.
    api_key: str = ""
    # FP8 recipe of the rollout engine (models.fp8.get_recipe names); embedded backend only.
    recipe: str = "fp8_block"
    # Samples per prompt (the GRPO group size).
    n: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 6
    # Sequences the embedded engine decodes at once (vLLM's --max-num-seqs; for servers, give
    # it to the server): a larger batch runs in chunks of it, which bounds the KV cache. The
    # samples do not depend on it (rollout_bridge.engine.embedded).
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    # KV cache of rollout (vLLM's --kv-cache-dtype): "auto" (the compute dtype), "bf16", or
    # "fp8" (E4M3 keys and values, one K and one V scale per layer, models.kv_quant). With
    # "fp8" the scales are recalibrated from the policy at every weight sync (amax / 448 over
    # the latest rollout's sequences): the embedded engine does it itself, servers (started
    # with --kv-cache-dtype fp8) receive them with each weight push (docs/rollout.md).
    kv_cache_dtype: str = "auto"
    # Seconds one HTTP request may wait for its answer; a request that times out (or finds
    # the server refusing / dropping the connection) is tried again `max_retries` times.
    timeout_s: float = 60.0
    # Extra attempts after such a failure, with backoff 0.5 s x 2^k. A server still failing
    # then is dropped (rollout.urls: its prompts go to the others) or stops the run (one server).
    max_retries: int = 3
    # Format of pushed weights (rollout_bridge.export): "fp8" (block-FP8 checkpoint format, a
    # GPU vLLM), "fp8_fp32" (FP8-rounded values in fp32, a CPU vLLM), "bf16", "fp32";
    # empty = the backend's default (http: bf16; embedded: fp8 for an FP8 block recipe, else
    # fp32; `jfp8rl.trainer.backends.push_format`). A bf16 push is rounded on the trainer's devices.
    export_format: str = ""
    # Per-tensor digest of each export, checked by the servers before they serve it
    # (rollout_bridge.weights.hashing): "xxh3_128" (fast, not cryptographic), "blake3" or
    # "sha256" (cryptographic: for an export_root that others than this run can write);
    # empty = xxh3_128.
    export_hash: str = ""
    # DAPO dynamic sampling: drop groups whose rewards are all equal and sample more prompts,
    # at most `max_rounds` extra rounds; slots still empty are filled with dropped groups whose
    # loss mask is zero (static shapes), and counted in `rollout/filled_groups`.
    dynamic_sampling: bool = False
    max_rounds: int = 2
    # One-step off-policy rollout: 1 samples step k+1's batch (on the servers, or the
    # embedded engine on its own thread) while step k updates, with the weights of step k-1;
    # the correction (algorithm.correction) then weighs the samples by their own behaviour
    # logprobs. 0: each step samples with the newest weights, then trains (on-policy).
    # A step that saves a checkpoint starts no rollout ahead, so a resume is exact
    # (jfp8rl.trainer.overlap; docs/rollout.md).
    max_staleness: int = 0
    # verl's free_cache_engine: the embedded engine drops its weights once the step's rollout
    # is sampled, and the step's weight sync installs the new ones, so the engine's weights
    # (a model's size in f32 operands) are not alive beside the trainer's update. Only where
    # the engine would otherwise sit idle: the embedded backend at max_staleness 0 (at 1 it
    # samples the next batch during the update; servers keep their weights on their hardware).
    free_cache_engine: bool = True
    # True on-policy rollouts: "exact" runs the policy with batch-invariant numerics
    # (models.invariant) in the embedded engine and in the trainer, so the engine's sampled-token
    # log-probs equal, bit for bit, what the trainer computes for the same tokens; the trainer
    # then takes them as the old log-probs (verl's "bypass" mode) instead of recomputing them.
    # Needs the embedded backend, rollout.recipe = train.recipe in {bf16, fp8_block}, no top-k /
    # top-p, kv_cache_dtype auto, max_staleness 0, no tensor parallelism, a CPU backend; the
    # weights are pushed as fp32 (rollout.export_format empty or fp32).
    # "off": the engine's own numerics; the trainer recomputes the old log-probs.
    on_policy: str = "off"
    # With on_policy=exact: every N steps (and at step 1) recompute the old log-probs of one
    # mini-batch and log rollout_corr/exact_share (1.0 when exact) and rollout_corr/max_abs_dlogp;
    # 0 = never.
    on_policy_check_every: int = 10
    # Routing replay (R3) for Mixture-of-Experts models: "record" has the rollout return each
    # token's experts (every layer's top-k) with the sample, and the trainer's `prepare` and
    # update replay them instead of its own router's choice (the gates stay the router's
    # probabilities of the replayed experts, so the router still gets gradients), and log
    # rollout_corr/routing_mismatch: the share of (token, layer) pairs whose expert set the
    # trainer's own router, on the same weights, would have chosen differently. HTTP servers
    # must return the experts: vLLM started with --enable-return-routed-experts (its GPU
    # builds; the CPU build lacks the model runner it needs), `python -m rollout_bridge.serve
    # --enable-return-routed-experts`. "off": the trainer routes every token itself.
    routing_replay: str = "off"

    def server_urls(self) -> list[str]:
        """The rollout servers of backend "http": `urls`, else [`url` or the default]."""
        return list(self.urls) or [self.url or DEFAULT_ROLLOUT_URL]

    def __post_init__(self) -> None:
        check_choice("rollout", "backend", self.backend, ("embedded", "http"))
        if self.url and self.urls:
            raise ConfigError(
                f"rollout.url={self.url!r} and rollout.urls={list(self.urls)} are both given; "
                "keep one: rollout.url for one server, rollout.urls for several (set "
                "rollout.url= to empty it)"
            )
        check_choice("rollout", "recipe", self.recipe, RECIPES)
        check_choice(
            "rollout", "export_format", self.export_format, ("", "fp8", "fp8_fp32", "bf16", "fp32")
        )
        check_choice("rollout", "export_hash", self.export_hash, ("", *HASHES))
        check_choice("rollout", "kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        check_positive("rollout", "n", self.n)
        check_positive("rollout", "max_tokens", self.max_tokens)
        check_positive("rollout", "max_num_seqs", self.max_num_seqs)
        check_positive("rollout", "timeout_s", self.timeout_s)
        check_positive("rollout", "max_retries", self.max_retries, allow_zero=True)
        check_positive("rollout", "temperature", self.temperature)
        check_positive("rollout", "max_rounds", self.max_rounds, allow_zero=True)
        check_choice("rollout", "max_staleness", self.max_staleness, MAX_STALENESS)
        # YAML reads a bare `off` as false, which the str field holds as "False".
        if self.on_policy in ("False", "false"):
            self.on_policy = "off"
        check_choice("rollout", "on_policy", self.on_policy, ON_POLICY)
        check_positive(
            "rollout", "on_policy_check_every", self.on_policy_check_every, allow_zero=True
        )
        if self.on_policy == "exact":
            self._check_exact()
        if self.routing_replay in ("False", "false"):
            self.routing_replay = "off"
        check_choice("rollout", "routing_replay", self.routing_replay, ROUTING_REPLAY)

    def _check_exact(self) -> None:
        """What `on_policy: exact` cannot hold to, refused with the key and the way out."""
        why = [
            (self.backend != "embedded", f"rollout.backend={self.backend} (a server's kernels "
             "are not batch-invariant): use rollout.backend=embedded"),
            (self.recipe not in EXACT_RECIPES, f"rollout.recipe={self.recipe}: use one of "
             f"{', '.join(EXACT_RECIPES)} (fp8_tensor's batch-wide amax couples the rows)"),
            (self.top_k > 0 or self.top_p < 1.0, f"rollout.top_k={self.top_k} / rollout.top_p="
             f"{self.top_p} (the trainer scores the untruncated distribution): set top_k=-1, "
             "top_p=1.0"),
            (self.kv_cache_dtype != "auto", f"rollout.kv_cache_dtype={self.kv_cache_dtype}: "
             "use auto"),
            (self.max_staleness != 0, f"rollout.max_staleness={self.max_staleness}: use 0"),
            (self.export_format not in ("", "fp32"), f"rollout.export_format="
             f"{self.export_format} (it rounds the norms and embeddings): leave it empty"),
        ]  # fmt: skip
        for bad, message in why:
            if bad:
                raise ConfigError(f"rollout.on_policy=exact cannot hold with {message}")
