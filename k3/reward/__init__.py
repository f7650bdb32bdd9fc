"""k3 rewards: verifiers (math, Python unit tests, worlds) and the generative judge (docs/rl.md)."""
