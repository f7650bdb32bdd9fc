"""k3 reinforcement learning: rollouts on the in-process engine, losses, effort budgets, the loop (docs/rl.md)."""
