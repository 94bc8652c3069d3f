"""One-step off-policy rollout (`rollout.max_staleness: 1`): step k+1's batch is sampled while
step k updates.

Timeline of step k (`jfp8rl.trainer.stages.train_step`):

    take      step k's batch: the one started during step k-1 (waits for it to finish), else
              sampled now with the newest weights, `step-<k-1>`
    start     step k+1's batch on a worker thread, with the weights the backend serves now
              (`step-<k-1>`): its prompts from the data position after step k's batch, its
              seed from (train.seed, k+1), as a synchronous run would draw them
    update    prepare and the optimizer updates of step k (main thread), meanwhile
    settle    wait until step k+1's batch is complete: the backend is never asked to sample
              and to load weights at once, and each batch has a single weight version
    sync      push `step-<k>`; step k+2's batch will sample with it

So a batch sampled ahead is one update behind the params that train on it (`rollout/staleness`
1; the first step's is 0). The PPO ratio is taken against the params before the update
(`old_logp`); the engine's own logprobs of the samples (`rollout_logp`, under the weights that
sampled them) are what `algorithm.correction` weighs against, so its importance weights cover
the policy's move as well as the FP8 rollout's mismatch.

Checkpoints: a step that saves a checkpoint (every `checkpoint.every` steps, the last step)
starts no batch ahead. Its checkpoint thus never has a batch in flight, and the next step samples
with the checkpointed weights in a resumed run and in an uninterrupted one alike: a resume is
exact. What it costs is the overlap of one step in `checkpoint.every`. A run stopped between
checkpoints (a lost server, Ctrl-C) drops the batch in flight with the rest of its unsaved steps;
a resume repeats them all from the checkpoint, identically. A run that `train.max_nonfinite`
stops saves a checkpoint at a step that may have sampled ahead; that batch is dropped too, and
the resume samples it again with the checkpointed weights.

Several trainer processes: process 0 alone runs the worker thread and talks to the backend; the
batch reaches the others when it is taken (`share_rollout`, a collective on the main thread).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
from collections.abc import Callable

from jfp8rl.data.batch import RolloutBatch
from jfp8rl.parallel import distributed
from jfp8rl.trainer.rollout import share_rollout

Collected = tuple[RolloutBatch, int, dict[str, float]]


@dataclasses.dataclass
class InFlight:
    """A batch sampled ahead: the step it is for, the weight version (the step whose params)
    it samples with, and its future (process 0; None on the others)."""

    step: int
    version: int
    future: cf.Future[Collected] | None


class RolloutAhead:
    """At most one batch sampled ahead on a worker thread (module docstring)."""

    def __init__(self) -> None:
        self.pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-ahead")
        self.pending: InFlight | None = None

    def start(self, step: int, version: int, collect: Callable[[], Collected]) -> None:
        """Starts `collect()` (step `step`'s batch with weights `version`) on the worker
        thread of process 0."""
        if self.pending is not None:
            raise AssertionError(f"a batch for step {self.pending.step} is still in flight")
        future = self.pool.submit(collect) if distributed.is_main() else None
        self.pending = InFlight(step, version, future)

    def take(self, step: int) -> tuple[Collected, int] | None:
        """(batch, data position, stats; the weight version it sampled with) of step `step`
        started earlier, once complete, on every process; None when none was started. An
        error of the rollout (a lost server, ...) is raised here, on every process."""
        got, self.pending = self.pending, None
        if got is None:
            return None
        if got.step != step:
            raise AssertionError(f"the batch in flight is for step {got.step}, not {step}")
        return share_rollout(lambda: got.future.result()), got.version  # type: ignore[union-attr]

    def settle(self) -> None:
        """Waits until the batch in flight (if any) is complete; its error, if any, is raised
        by `take`."""
        if self.pending is not None and self.pending.future is not None:
            cf.wait([self.pending.future])

    def close(self) -> None:
        """Waits for a batch still in flight (its result or error dropped: the run is ending)
        and stops the worker thread; then the backend may be closed."""
        self.settle()
        self.pending = None
        self.pool.shutdown(wait=True)
