"""RL on kvpage beyond one synchronous batch: :class:`~kvpage.rl.async_rollouts.AsyncRollouts`
(rollouts that keep generating while the trainer steps)."""

from kvpage.rl.async_rollouts import AsyncRollouts, RolloutSample

__all__ = ["AsyncRollouts", "RolloutSample"]
