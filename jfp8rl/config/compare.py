"""Which config changes a run folder accepts on resume: `differences` between the resolved
config a checkpoint was trained with and the one asked for now, leaving out `RESUMABLE`.

A resume must train what the checkpoint trained: every key that changes the samples, the
loss, the update, the data order or the base policy has to be equal. What may change between
invocations of one run (`RESUMABLE`, prefixes of dotted keys):

    run_dir                         the folder itself may be moved or copied
    train.steps, train.stop_after   extend (or stop) a run
    train.eval_every, eval.*        when and how the greedy eval runs (it changes no weights)
    train.max_nonfinite             how many skipped updates in a row stop the run
    train.jax_cache_dir             the compilation cache
    train.mesh.*                    the device mesh: the state is restored into the current
                                    mesh's shardings (the math is the same up to the order of
                                    sharded sums), so a run may move to more or fewer devices
    checkpoint.*                    save cadence, how many are kept, final export, resume check
    logging.*                       console, TensorBoard, rollout dumps
    rollout.backend, rollout.url, rollout.urls, rollout.api_key, rollout.export_root,
    rollout.export_hash, rollout.timeout_s, rollout.max_retries
                                    which engine samples (embedded or servers), where the
                                    servers are, how they are reached and exports checked
    rollout.max_num_seqs            sequences decoded at once (the samples do not depend on it)
    rollout.on_policy_check_every   how often the exact on-policy check is logged
    rollout.free_cache_engine       whether the engine drops its weights between rollout and
                                    sync (the next push installs the same numbers)
    warmstart.cache_dir             where the base policy is cached (its key names the policy)
"""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from jfp8rl.config.run import Config

RESUMABLE = (
    "run_dir",
    "train.steps",
    "train.stop_after",
    "train.eval_every",
    "train.max_nonfinite",
    "train.jax_cache_dir",
    "train.mesh.",
    "eval.",
    "checkpoint.",
    "logging.",
    "rollout.backend",
    "rollout.url",
    "rollout.urls",
    "rollout.api_key",
    "rollout.export_root",
    "rollout.export_hash",
    "rollout.timeout_s",
    "rollout.max_retries",
    "rollout.max_num_seqs",
    "rollout.on_policy_check_every",
    "rollout.free_cache_engine",
    "warmstart.cache_dir",
)


def flatten(cfg: Config) -> dict[str, Any]:
    """The config as {dotted key: value} (lists and dicts of values stay whole)."""
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict) and key != "chat_template_kwargs":
                walk(value, f"{prefix}{key}.")
            else:
                out[f"{prefix}{key}"] = value

    walk(OmegaConf.to_container(OmegaConf.structured(cfg)), "")
    return out


def resumable(key: str) -> bool:
    """Whether `key` may differ between a checkpoint's config and the resuming one."""
    return any(key == r or (r.endswith(".") and key.startswith(r)) for r in RESUMABLE)


def differences(old: Config, new: Config) -> list[tuple[str, Any, Any]]:
    """(key, old value, new value) of every key outside `RESUMABLE` that differs, in the
    config's order."""
    a, b = flatten(old), flatten(new)
    return [(k, a.get(k), b.get(k)) for k in b if not resumable(k) and a.get(k) != b.get(k)]
