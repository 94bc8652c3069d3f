"""jfp8rl losses: pure, jit-compilable RL loss math on masked [B, T] arrays.

Modules (import them directly; this package imports nothing heavy beyond jax):
    advantages          GRPO / Dr.GRPO / RLOO advantages, broadcast to tokens
    policy              clipped surrogate (PPO/GRPO/DAPO/Dr.GRPO/GSPO), dual clip, diagnostics
    rollout_correction  TIS / IcePop / MIS importance weights (verl's rollout_is), off-policy
                        metrics
    rollout_rejection   rejection masks from k1 / k2 / k3 divergences (verl's rollout_rs)
    kl                  k1 / k2 / k3 KL to a reference: loss term or reward penalty
    entropy             entropy bonus
    calibrated          Calibrated Clipping (CalibConfig, CalibState, calibrate, current_bounds)
    registry            named algorithms and `compute_loss`, the trainer's entry point
    masked              masked reductions and loss aggregation (sums and denominators apart)
    checks              trace-time argument checks
"""
