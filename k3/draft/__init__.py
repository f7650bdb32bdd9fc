"""Training the EAGLE-3 draft (`k3.model.draft`) on the target's own generations: `k3 train-draft`."""
