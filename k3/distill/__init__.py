"""Multi-teacher on-policy distillation (docs/distill.md)."""
